"""Process-group plumbing that works the same under Ray Train, torchrun and a single process."""

from __future__ import annotations

import datetime as _dt
import os

import torch
import torch.distributed as dist


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
        dist.init_process_group(
            backend="nccl" if use_gpu else "gloo", timeout=_dt.timedelta(seconds=timeout_s)
        )


def backend_name() -> str:
    return dist.get_backend() if dist.is_initialized() else "none"


def all_reduce_sums(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum each value over all ranks with a single collective."""
    if not sums:
        return {}
    names = sorted(sums)
    packed = torch.stack([sums[k].detach().to(torch.float64).reshape(()) for k in names])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(packed)
    return dict(zip(names, packed.tolist(), strict=True))


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
