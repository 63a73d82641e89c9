"""Replica groups (`fault_tolerance:`, torchft): the loop's side of a run split into groups that
fail and heal alone (docs/fault-tolerance.md).

The launcher starts each group as an ordinary worker group (Ray: one Ray Train run per group), so
inside the loop the runtime's rank and world size, and torch.distributed's default group, are the
group's: DDP, FSDP and TP inside a group run on it unchanged. Across groups torchft's `Manager`
takes the place of the data-parallel replicate dimension: each step starts a quorum (which groups
take part), the gradients are averaged over the groups in it, and the optimizer steps only if the
step is committed. A group that joins behind the others (restarted, or a step it did not commit)
copies a live peer's state at its next step: weights, optimizer state, the Trainer's progress
(step, epoch, batch in epoch, LR schedule), not a checkpoint from storage, over raylane's own
transport (raylane.loop.distributed.ft_transport: served on this node's address, not every
interface, and loaded with `weights_only=True`, not torchft's default's unpickling). Under
`fault_tolerance.semi_sync` the groups meet every `sync_steps` steps instead, through torchft's
LocalSGD or DiLoCo (raylane.loop.distributed.ft_semisync).

What the launcher gives each worker (environment): `RAYLANE_REPLICA_GROUP` (the group's index, from
0), `RAYLANE_REPLICA_GROUPS` (their count), `TORCHFT_LIGHTHOUSE` (the quorum service's address),
`MASTER_ADDR` (a host of the group's rank 0 that the other groups reach). The Manager's own
TCPStore is hosted by the group's rank 0 on a free port at MASTER_ADDR, apart from torch's (a
group of one process has none), its port shared over the group.

Why not torchft's own wrappers: its `DistributedDataParallel` crashes the surviving group when a
peer dies in an all-reduce (torchft 0.2.0, ddp.py:76's assert), so the cross-group reduce is done
here: after the group's own backward (DDP's in-group reduce), `manager.allreduce` on flat buckets
of the gradients; under FSDP2, FSDP's all-reduce hook sends each reduce-scattered gradient shard
through the Manager. The recovery state is read by torchft's quorum thread while the main thread
runs forward and backward: it is references to the parameters' local shards and the optimizer's
state tensors, never `module.state_dict()` (FSDP2's state-dict hooks reshard) nor DCP's getters
(a peer healed from those crashed in its next backward). Never imports Ray; torchft is imported
only when a run has replica groups."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from raylane.loop.protocols.events import ReplicaHealed, ReplicaQuorum

log = logging.getLogger("raylane")

GROUP_ENV, GROUPS_ENV, LIGHTHOUSE_ENV = "RAYLANE_REPLICA_GROUP", "RAYLANE_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE"
# Gradients cross groups in flat buckets of about this size: one all-reduce each, not one a tensor.
BUCKET_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class ReplicaGroup:
    """This worker's replica group: its `index` (from 0) of `count`, and the lighthouse's address."""

    index: int
    count: int
    lighthouse: str


def replica_group() -> ReplicaGroup | None:
    """This worker's replica group, as its launcher set it in the environment; None without one."""
    index = os.environ.get(GROUP_ENV)
    if index is None:
        return None
    count = int(os.environ.get(GROUPS_ENV, "0"))
    if not 0 <= int(index) < count:
        raise ValueError(f"{GROUP_ENV} = {index}: not a group of {GROUPS_ENV} = {count}")
    return ReplicaGroup(int(index), count, os.environ.get(LIGHTHOUSE_ENV, ""))


def world_of(group_world: int) -> int:
    """The run's whole world, of which this worker's group is `group_world` ranks."""
    group = replica_group()
    return group_world * group.count if group is not None else group_world


class OneReplica:
    """The run as one replica, without replica groups: every step is taken and counted, nothing
    crosses groups, this group reports and checkpoints. The Trainer's steps ask it the same
    questions as `ReplicaGroups` (`begin`, `reduce`, `commit`), which it answers for free."""

    count = 1  # replica groups in the run
    committed = True  # the last step was taken (its optimizer step, or its skip)

    def joined(self, step: int) -> contextlib.AbstractContextManager[None]:
        """The loop's span, from `step` (0, or a resume's) to its end however it ends."""
        return contextlib.nullcontext()

    def begin(self, step: int) -> None:
        """Step `step + 1` starts (before its forward)."""

    def reduce(self) -> None:
        """The step's gradients, reduced in the group, averaged over the groups."""

    def commit(self) -> bool:
        """Whether the step is taken; False: no group takes it, and its data is read again."""
        return True

    def healed(self) -> bool:
        """The last commit copied a peer's state: the Trainer's position is the peer's now."""
        return False

    def leads(self) -> bool:
        """This group writes the run's checkpoints and reports its figures (the lowest group alive)."""
        return True

    def carry(self, state_dict: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        """The Trainer's own state, which a healing group copies from a peer with the weights."""


class GroupDataRanks:
    """The data ranks of a run with replica groups: group `index`'s data-parallel rank r reads
    shard index x size + r of count x size (torchtitan's), so the groups read apart and a step's
    samples are the whole run's. A stream is read here (the launcher's own splits by group)."""

    def __init__(self, data: Any, group: ReplicaGroup) -> None:
        self.world_size = data.world_size * group.count
        self.rank = group.index * data.world_size + data.rank

    def data_stream(self, name: str, source: Any, *, batch_size: int) -> Any | None:
        return None


def train_ranks(data: Any, replicas: OneReplica) -> Any:
    """What the training data is split by: `data` (the group's data ranks), across the groups."""
    group = getattr(replicas, "group", None)
    return data if group is None else GroupDataRanks(data, group)


class StartBarrier(Exception):
    """Why a group did not commit a step: the others have not joined the run's first quorum yet."""


class ReplicaGroups(OneReplica):
    """A replica group's steps under torchft's Manager (see the module's doc)."""

    reduces_gradients = True  # every step's, across groups (semi-sync's groups meet every few steps instead)

    def __init__(
        self, manager: Any, group: ReplicaGroup, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **kw: Any
    ) -> None:
        self.manager, self.group, self.count = manager, group, group.count
        self._store = kw.get("store")  # the Manager's TCPStore, while it lives (group rank 0)
        self._seed, self._reporter = int(kw.get("seed", 0)), kw["reporter"]  # rank 0's tells the driver
        self._rank0 = kw.get("rank", 0) == 0
        self.optimizer = optimizer
        # Taken once: reading them later runs no module hook (see the module's doc).
        self._named = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self._buffers = dict(model.named_buffers())
        self._params = list(self._named.values())
        self._sharded = _hook_fsdp(model, self._all_reduce) if self.reduces_gradients else False
        self._healed, self._started, self._began_at, self.heals = False, 0.0, 0, 0
        self._start_wait_s, self._waiting_since = float(kw.get("start_wait_s", 0.0)), 0.0
        # The groups that took part: at the last commit, the fewest over the window, and the steps
        # taken with fewer than the run's.
        self._alive, self._alive_min, self.steps_below_full = group.count, group.count, 0
        self._reporter.replicas = self
        manager.register_state_dict_fn("model", self._load_model, self._model_state)
        manager.register_state_dict_fn("optimizer", self._load_optimizer, self._optimizer_state)

    def carry(self, state_dict: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        def healed(state: dict[str, Any]) -> None:
            load(state)
            self._healed = True

        self.manager.register_state_dict_fn("trainer", healed, state_dict)

    @contextlib.contextmanager
    def joined(self, step: int) -> Iterator[None]:
        """The Manager from the step the loop starts at (a resume's checkpoint's, before the first
        quorum: only a peer ahead of it heals this group), shut down however the loop ends."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.count})
        try:
            yield
        finally:
            self.manager.shutdown(wait=False)

    # -- a step --------------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        if self.manager.current_step() != step:
            raise RuntimeError(
                f"replica group {self.group.index}: the loop is at step {step}, torchft's Manager at "
                f"{self.manager.current_step()}"
            )
        # The random generators by step: a group that heals draws what its peers draw.
        reseed(self._seed, step)
        self._started, self._began_at = time.perf_counter(), step
        self.manager.start_quorum()

    def reduce(self) -> None:
        if not self._sharded:  # FSDP's hook has reduced them
            self._reduce_gradients()

    def commit(self) -> bool:
        # A heal is applied in should_commit only once the quorum is in (the reduce waits for it;
        # a step with no gradient to reduce would not).
        self.manager.wait_quorum()
        self._await_the_others()
        self.committed = self.manager.should_commit()
        if self.committed:
            self._count(self.manager.num_participants(), self.manager.current_step())
        else:
            self._refused()
        return self.committed

    def _await_the_others(self) -> None:
        """The start barrier: a step from the run's first state (step 0 in the quorum: no group
        has trained) taken by fewer than all groups is not committed, until all are in or
        `start_wait_s` (the quorum timeout) has passed since this group's first such quorum. Why:
        the first group up would step alone and the others heal from it, and a restarted group
        whose first quorum missed the live ones (their heartbeats late on a busy machine) would
        step alone from its fresh weights; either loses steps. The quorum's participants all see
        the same step and count, so they decide alike (at the deadline one may commit while
        another repeats the step: it heals from the first at the next)."""
        if self.manager.current_step() != 0 or self.manager.num_participants() >= self.count:
            return
        now = time.monotonic()
        if not self._waiting_since:
            self._waiting_since = now
            if self._rank0:  # a warning: a rank's info lines stay in its log, and this wait shows
                log.warning(
                    "replica group %d: %d of %d groups in the quorum at the start; waiting for the others "
                    "(up to %.0f s: fault_tolerance.quorum_timeout_s)",
                    self.group.index,
                    self.manager.num_participants(),
                    self.count,
                    self._start_wait_s,
                )
        if now - self._waiting_since < self._start_wait_s:
            self.manager.report_error(StartBarrier("waiting for the other replica groups at the run's start"))

    def _refused(self) -> None:
        """A heal whose state was refused (not only tensors and plain values) ends the run: every
        step would fetch it again."""
        from raylane.loop.distributed.ft_transport import HealRefused

        error = self.manager.errored()
        if isinstance(getattr(error, "original_exception", None), HealRefused):
            raise HealRefused(f"replica group {self.group.index}: {error.original_exception}") from None

    def _count(self, alive: int, step: int, steps: int = 1) -> None:
        """`steps` to `step` taken by `alive` groups: the window's and run's figures, the events."""
        leads = self.leads()
        self._alive_min = min(self._alive_min, alive)
        self.steps_below_full += steps if alive < self.count else 0
        reporter = self._reporter
        reporter.leads = leads
        if leads and alive != self._alive:
            reporter.on_replicas(ReplicaQuorum(step=step, alive=alive, groups=self.count))
        self._alive = alive
        if self._healed:
            self.heals += 1
            seconds = time.perf_counter() - self._started
            reporter.on_replicas(ReplicaHealed(self.group.index, step, self._began_at, round(seconds, 3)))
            if self._rank0:
                log.warning(
                    "replica group %d healed from a peer: it took step %d with them, its own state at step %d "
                    "(%.2f s into the step)",
                    self.group.index,
                    step,
                    self._began_at,
                    seconds,
                )

    def window(self) -> dict[str, float]:
        """The logging window's figure (MLflow's train/replica_groups): the fewest groups that took
        a step of it together; the next window counts from the groups now."""
        fewest, self._alive_min = self._alive_min, self._alive
        return {"replica_groups": float(fewest)}

    def summary(self) -> dict[str, int]:
        """The run's figures from this group (RunResult.replicas)."""
        return {"groups": self.count, "heals": self.heals, "steps_below_full": self.steps_below_full}

    def healed(self) -> bool:
        healed, self._healed = self._healed, False
        return healed

    def leads(self) -> bool:
        return self.manager.participating_rank() == 0

    def _all_reduce(self, grad: torch.Tensor) -> None:
        self.manager.allreduce(grad).wait()

    def _reduce_gradients(self) -> None:
        """Every trainable parameter's gradient averaged over the groups, in flat buckets (a
        missing one as zeros, so that every group's buckets line up; None again where every
        group had none)."""
        missing = []
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                missing.append(p)
        works = []
        for grads in _buckets([_local(p.grad) for p in self._params]):
            flat = torch.cat([g.reshape(-1) for g in grads])
            works.append((self.manager.allreduce(flat), flat, grads))
        for work, flat, grads in works:
            work.wait()
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        for p in missing:
            if not bool(p.grad.any()):
                p.grad = None

    # -- the state a healing peer copies (read on torchft's quorum thread) --------------------

    def _model_state(self) -> dict[str, Any]:
        return {name: _local(t) for name, t in (*self._named.items(), *self._buffers.items())}

    def _load_model(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, t in (*self._named.items(), *self._buffers.items()):
                _local(t).copy_(state[name])

    def _optimizer_state(self) -> dict[str, Any]:
        states = self.optimizer.state
        return {
            "state": {
                name: {k: _local(v) for k, v in states[p].items()} for name, p in self._named.items() if p in states
            },
            "groups": [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups],
        }

    def _load_optimizer(self, state: dict[str, Any]) -> None:
        kept_on_device = any(g.get("fused") or g.get("capturable") for g in self.optimizer.param_groups)
        with torch.no_grad():
            for name, p in self._named.items():
                theirs = state["state"].get(name)
                if theirs is None:
                    self.optimizer.state.pop(p, None)
                    continue
                mine = self.optimizer.state[p]
                for key, value in theirs.items():
                    if not torch.is_tensor(value):
                        mine[key] = value
                    elif torch.is_tensor(mine.get(key)) and _local(mine[key]).shape == value.shape:
                        _local(mine[key]).copy_(value)
                    else:  # a state this rank has not made yet (it has not stepped)
                        mine[key] = _like(p, value, kept_on_device)
        for group, theirs in zip(self.optimizer.param_groups, state["groups"], strict=True):
            group.update(theirs)


def _hook_fsdp(model: torch.nn.Module, all_reduce: Callable[[torch.Tensor], None]) -> bool:
    """FSDP2's all-reduce hook on each of `model`'s FSDP modules (the gradient shards its
    reduce-scatter leaves, averaged over the groups); False when no module is FSDP's."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.set_all_reduce_hook(all_reduce)
    return bool(sharded)


def reseed(seed: int, step: int) -> None:
    """torch's, numpy's and Python's generators from (`seed`, `step`) alone."""
    import random

    state = np.random.SeedSequence([seed, step]).generate_state(2, dtype=np.uint64)
    torch.manual_seed(int(state[0]))
    np.random.seed(int(state[1]) % 2**32)
    random.seed(int(state[1]))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP, TP), else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _like(param: torch.Tensor, value: torch.Tensor, on_device: bool) -> torch.Tensor:
    """A peer's optimizer state tensor as this rank would have made it: a count (`step`) on the
    CPU unless the optimizer keeps it on the device (`on_device`: fused, capturable), any other
    laid out as `param` (a DTensor under FSDP)."""
    if not value.dim():
        return value.detach().clone().to(param.device if on_device else "cpu")
    value = value.detach().clone().to(param.device)
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return value


def _buckets(grads: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """`grads` in buckets of one dtype and device, about BUCKET_BYTES each, in their order."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        if bucket and (size + g.numel() * g.element_size() > BUCKET_BYTES or g.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        yield bucket
