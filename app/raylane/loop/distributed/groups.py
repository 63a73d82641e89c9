"""Process-group plumbing that works the same under Ray Train, torchrun and a single process."""

from __future__ import annotations

import datetime as _dt
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("raylane")
# One name per node in every record (health, step times, stacks, profiles).
NODE_ENV = "RAYLANE_NODE_NAME"


def node_name() -> str:
    """This node's name in a run's records: $RAYLANE_NODE_NAME where set (nodes that share a host
    name, e.g. containers, or two launches on one machine), else the host name."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


def env_ranks() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun and Ray Train both export them."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
    )


def default_device(use_gpu: bool, local_rank: int) -> torch.device:
    if not use_gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("scaling.use_gpu is true but CUDA is not available on this worker")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_process_group(use_gpu: bool, timeout_s: float = 300.0) -> None:
    """Join the group torchrun describes in the environment (Ray Train has already done it)."""
    _, _, world_size = env_ranks()
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_gpu else "gloo", timeout=_dt.timedelta(seconds=timeout_s))


def leave_process_group(wait_for_peers: bool) -> None:
    """Leave torchrun's group. `wait_for_peers` after a graceful stop only: every rank then exits
    130, and torchrun stops the others as soon as one exits non-zero, so each waits for every
    rank (rank 0 closes its MLflow run KILLED and writes the summary first; a stop logs no model).
    After a run that FINISHED no rank waits: torchrun leaves the others running when one exits 0,
    and rank 0's end-of-run work (the MLflow model: minutes for a large one) has no length a
    peer could bound its wait by. After a failure no rank waits: the peers may be stuck in a
    collective."""
    if not dist.is_initialized():
        return
    if wait_for_peers and dist.get_world_size() > 1:
        try:
            dist.barrier()
        except Exception as exc:  # noqa: BLE001 - the run's outcome is decided: this rank leaves as it is
            log.warning("left without waiting for the other ranks: %s", (str(exc).splitlines() or [""])[0])
    dist.destroy_process_group()


def node_layout(node_key: bytes, device: torch.device) -> list[int]:
    """Each rank's node rank, nodes numbered in rank order, from an all-gather of `node_key`
    (a fixed-length id of this rank's node). Ranks on one node are contiguous, as both torchrun
    and Ray Train place them."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [0]
    mine = torch.frombuffer(bytearray(node_key), dtype=torch.uint8).to(device)
    keys = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(keys, mine)
    order: dict[bytes, int] = {}
    return [order.setdefault(bytes(k.cpu().tolist()), len(order)) for k in keys]


def backend_name() -> str:
    return dist.get_backend() if dist.is_initialized() else "none"


def all_reduce_sums(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum each value over all ranks with a single collective."""
    if not sums:
        return {}
    names = sorted(sums)
    # NCCL reduces device tensors only: gather on the device of any tensor not on the CPU.
    device = next((v.device for v in sums.values() if v.device.type != "cpu"), torch.device("cpu"))
    packed = torch.stack([sums[k].detach().to(device, torch.float64).reshape(()) for k in names])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(packed)
    return dict(zip(names, packed.tolist(), strict=True))


def all_reduce_max(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """The largest of each value over all ranks, with a single collective."""
    names = sorted(values)
    packed = torch.tensor([float(values[k]) for k in names], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return dict(zip(names, packed.tolist(), strict=True))


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class ControlVote:
    """Decisions every rank must take at the same step (stop for preemption, commit a finished
    async checkpoint, how many steps until the next vote), agreed by one all-reduce(SUM) of a
    few flags and values at a step boundary: a flag is set when any rank set it.

    Synchronous on purpose: an async all-reduce overlapped with the next step (read one step
    later) made gloo abort at process exit in about 1 run in 4 ("terminate called without an
    active exception"). It runs on `group` (a gloo group on GPU, so it never waits on a CUDA
    stream). Every rank must call `poll` the same number of times, with as many values."""

    def __init__(self, n_flags: int, group: dist.ProcessGroup | None = None) -> None:
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.group = group
        self.n_flags = n_flags

    def poll(
        self, *flags: bool, values: tuple[float, ...] = (), per_rank: tuple[float, ...] = ()
    ) -> tuple[list[bool], list[float]]:
        """(each flag set on any rank, each value summed over the ranks, then every rank's
        `per_rank` in rank order). `per_rank` rides in the same all-reduce: each rank fills its
        own slot of a block of world size x len(per_rank) zeros, and the sum is every rank's."""
        if not self.distributed:
            return [bool(f) for f in flags], [*values, *per_rank]
        head = [float(bool(f)) for f in flags] + [float(v) for v in values]
        buffer = torch.zeros(len(head) + len(per_rank) * dist.get_world_size(), dtype=torch.float64)
        buffer[: len(head)] = torch.tensor(head, dtype=torch.float64)
        if per_rank:
            at = len(head) + dist.get_rank() * len(per_rank)
            buffer[at : at + len(per_rank)] = torch.tensor(per_rank, dtype=torch.float64)
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
        reduced = buffer.tolist()
        return [v > 0 for v in reduced[: len(flags)]], reduced[len(flags) :]

    def close(self) -> None:
        """Nothing is left in flight (kept for callers that drain at the end)."""


def node_names(group: dist.ProcessGroup | None = None) -> list[str]:
    """Each rank's node name (node_name()), in rank
    order: one all-gather, once, before the first step."""
    mine = node_name()
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine]
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, mine, group=group)
    return [str(n) for n in names]
