"""One rank of a rehearsal laid out for real: this process plays rank r of N on torch's `fake`
process group (shapes only, nothing sent), and a meta copy of the pipeline's model goes through
raylane's own `parallelize` (raylane.loop.distributed.parallelize: the strategy chosen as on the
ranks, the tp plan, the pipeline stage, FSDP2's shards), so what a rank holds is the run's layout
measured, not a formula. Which ranks are played: rank 0, the last pipeline stage's first rank, and
in each the last FSDP shard (FSDP2 pads dim 0 to a multiple of the shards: the last may hold less)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from raylane.loop.distributed.fake import fake_work, meta_copy
from raylane.loop.distributed.layout import Layout
from raylane.loop.rehearsal.target import Target


@dataclass
class Share:
    """What one rank holds once laid out: its parameters' bytes (its shards), those that train,
    the pipeline stages it runs, the layout and why it was chosen."""

    rank: int
    layout: Layout
    reason: str
    param_bytes: int
    trainable_bytes: int
    stages: list[int] = field(default_factory=list)

    def same_as(self, other: Share) -> bool:
        return (self.param_bytes, self.trainable_bytes, self.stages) == (
            other.param_bytes,
            other.trainable_bytes,
            other.stages,
        )


@contextlib.contextmanager
def playing(rank: int, target: Target) -> Iterator[None]:
    """Inside: this process is rank `rank` of `target.world` on torch's fake backend, its node's
    ranks (LOCAL_WORLD_SIZE, which the layout reads for HSDP's replicas) the target's. The default
    group is destroyed and the environment put back after."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the fake backend
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # a run's own group: never replaced by a rehearsal's
        raise RuntimeError("a rehearsal plays its ranks in a process without a process group")
    env = {"LOCAL_WORLD_SIZE": str(target.per_node), "LOCAL_RANK": str(rank % target.per_node)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("fake", rank=rank, world_size=target.world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def local_bytes(tensors: Any) -> int:
    """The bytes this rank holds of `tensors` (a DTensor's own shard)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def lay_out(pipe: Any, cfg: Any, target: Target, rank: int, example: Any = None) -> Share:
    """Rank `rank`'s share of the pipeline's model under `cfg`'s strategy at the target's size."""
    from raylane.loop.distributed.parallelize import parallelize

    with playing(rank, target), fake_work():
        model, blocks = meta_copy(pipe.model, pipe.blocks)
        given = pipe.blocks if pipe.blocks is None or isinstance(pipe.blocks, str) else blocks
        laid, strategy = parallelize(
            model,
            cfg,
            torch.device("meta"),  # shards stay shapes: nothing is allocated
            target.world,
            example=example,
            loss_fn=pipe.loss_fn,
            step=pipe.step,
            blocks=given,
            tp_plan=pipe.tp_plan,
            pp_stages=pipe.pp_stages,
            ep_plan=pipe.ep_plan,  # ep: auto's choice, said in the layout's why
        )
        params = list(laid.parameters())
        stages = [index for index, _ in laid.pipeline.stages] if hasattr(laid, "pipeline") else []
        return Share(
            rank,
            strategy.layout,
            strategy.reason,
            param_bytes=local_bytes(params),
            trainable_bytes=local_bytes(p for p in params if p.requires_grad),
            stages=stages,
        )


def ranks_to_play(layout: Layout) -> list[int]:
    """Rank 0 and the last pipeline stage's first rank (pp is the outermost dimension), and in
    each the rank of the last FSDP shard (dp_shard's stride is cp x tp): the ranks whose shares
    can differ. Everything else is one of these by symmetry: tensor-parallel ranks split evenly
    (the checks refuse a degree that does not divide), replicas hold alike."""
    per_stage = layout.world_size // layout.pp
    last_shard = (layout.dp_shard - 1) * layout.cp * layout.tp
    firsts = [0] if layout.pp == 1 else [0, (layout.pp - 1) * per_stage]
    return sorted({r + s for r in firsts for s in (0, last_shard)})
