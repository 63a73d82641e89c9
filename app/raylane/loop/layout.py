"""A run's layout over its ranks, named as the summary, the terminal's strategy line and MLflow's
tags show it (`fsdp×tp2`, `hsdp×tp2×pp2`), and what `strategy.tp: auto` chooses it from: each
candidate's per-rank bytes, measured by laying a meta copy of the model out for real on fake
process groups (no memory, no communication), and the activations estimated.

The mesh's dimensions are torchtitan's, outermost first: pp, dp_replicate, dp_shard, cp, tp."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from torch import nn

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """How many ranks each mesh dimension spans, and how the data-parallel ranks hold the model
    (`name`: ddp, fsdp or hsdp; single for one rank)."""

    name: str
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    def label(self) -> str:
        """`fsdp×tp2+sp`, `ddp×tp2`, `hsdp×tp2×pp2`: the data-parallel flavour where more than one
        rank holds a share of the batch (`tp2` where one group is the whole world), then each
        model-parallel dimension over more than one rank (`+sp`, `+lp`: sequence, loss parallel)."""
        parts = [self.name] if self.data_parallel > 1 else []
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + "+sp" * self.sequence_parallel + "+lp" * self.loss_parallel)
        parts += [f"{dim}{n}" for dim, n in (("cp", self.cp), ("pp", self.pp)) if n > 1]
        return "×".join(parts) or self.name

    def mesh_text(self) -> str:
        """The mesh's dimensions beyond data parallelism's, `dp_shard 2, tp 2` (the data-parallel
        ones always, the others where they span more than one rank); "" without any."""
        if self.tp == self.cp == self.pp == 1:
            return ""
        dims = [(d, getattr(self, d)) for d in MESH_DIMS]
        return ", ".join(f"{d} {n}" for d, n in dims if n > 1 or d in ("dp_shard", "tp"))


def parameter_bytes(
    model: nn.Module, blocks: Any, mesh_shape: tuple[int, int], plan: Any, *, sequence_parallel: bool
) -> int:
    """The bytes of parameters one rank holds under FSDP2 over `mesh_shape` = (dp_shard, tp), the
    pipeline's `plan` applied when tp > 1: measured, not computed, by laying out a meta copy of the
    model on process groups of torch's `fake` backend (shapes only; nothing is sent) over this
    process's world, whose size the mesh must have: the default process group's (a real one on
    the ranks, or a fake one in a test). Rank 0's share, the largest where shards are uneven.
    Collective (the groups are made by every rank)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the fake backend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from raylane.loop.blocks import blocks_of
    from raylane.loop.tensor_parallel import apply_plan

    meta, blocks = copy.deepcopy((model, blocks_of(model, blocks)))  # one copy: the blocks are the copy's
    meta.to("meta")
    names = ("dp_shard", "tp")
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names, backend_override=dict.fromkeys(names, "fake"))
    if mesh_shape[1] > 1:
        apply_plan(meta, plan, mesh["tp"], sequence_parallel=sequence_parallel)
    for block in blocks:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(meta, mesh=mesh["dp_shard"])
    total = 0
    for p in meta.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def tp_candidates(cfg: Any, world_size: int, node_ranks: int) -> list[int]:
    """The tensor-parallel degrees `strategy.tp: auto` may choose, smallest first: above 1,
    dividing the ranks of a node (a group's collectives stay on its links) and the world, and
    allowed by the config's own checks at that degree (a model's heads, vocabulary, block size)."""
    found = []
    for tp in range(2, node_ranks + 1):
        if node_ranks % tp or world_size % tp:
            continue
        as_fixed = cfg.model_dump()
        as_fixed["strategy"] |= {"tp": tp, "name": "fsdp"}
        try:
            type(cfg).model_validate(as_fixed)
        except ValueError:
            continue
        found.append(tp)
    return found


@dataclass
class Candidate:
    """One layout `strategy.tp: auto` weighs: its name in the estimate, its data-parallel flavour,
    tp, and the bytes one rank would hold."""

    key: str
    name: str
    tp: int
    bytes: int


def pick(candidates: list[Candidate], usable: float) -> tuple[Candidate, bool]:
    """The first candidate (the simplest: they come DDP, FSDP, then FSDP x TP by growing tp) whose
    bytes fit in `usable`, and True; else the one that needs least, and False."""
    for c in candidates:
        if c.bytes <= usable:
            return c, True
    return min(candidates, key=lambda c: c.bytes), False
