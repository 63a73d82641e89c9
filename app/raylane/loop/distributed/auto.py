"""What `strategy.tp: auto` chooses from: each candidate layout's per-rank bytes, measured by
laying a meta copy of the model out for real on fake process groups (raylane.loop.distributed.fake:
no memory, no communication), plus the activations, measured on a meta forward with the plan laid
out. raylane.loop.distributed.parallelize makes the choice a Strategy."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from raylane.loop.distributed.fake import fake_mesh, fake_work, meta_copy
from raylane.loop.distributed.layout import Layout

log = logging.getLogger("raylane")


def parameter_bytes(model: nn.Module, blocks: Any, layout: Layout, plan: Any, mesh: Any = None) -> int:
    """The bytes of parameters one rank holds under FSDP2 over `layout`'s data-parallel ranks, the
    pipeline's `plan` applied over its tp ranks when tp > 1 (sequence parallelism as the layout
    says): measured, not computed, by laying out a meta copy of the model on process groups of
    torch's `fake` backend (`fake_mesh`, or `mesh`: one made so) over this process's world, whose
    size the layout must have: the default process group's (a real one on the ranks, or a fake one
    in a test). Rank 0's share, the largest where shards are uneven. Collective (the groups are
    made by every rank)."""
    from torch.distributed.fsdp import fully_shard

    from raylane.loop.distributed.tensor_parallel import apply_plan

    meta, blocks = meta_copy(model, blocks)
    with fake_work():
        mesh = mesh if mesh is not None else fake_mesh(layout)
        if layout.tp > 1:
            apply_plan(meta, plan, mesh["tp"], sequence_parallel=layout.sequence_parallel)
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
    allowed by the config's own checks at that degree (a model's heads, vocabulary, block size).
    None when the config does not pass its checks here at tp 1 either (an input path this host
    cannot see): nothing would tell an allowed degree from another."""
    found = []
    for tp in range(1, node_ranks + 1):
        if node_ranks % tp or world_size % tp:
            continue
        as_fixed = cfg.model_dump()
        as_fixed["strategy"] |= {"tp": tp, "name": "fsdp"}
        if tp == 1:  # what needs tp > 1 is off there
            as_fixed["strategy"] |= {"sequence_parallel": False, "loss_parallel": False}
        try:
            type(cfg).model_validate(as_fixed)
        except ValueError as exc:
            if tp == 1:
                log.warning("strategy.tp: auto tries no tensor parallelism: the config's checks fail here (%s)", exc)
                return []
            continue
        found.append(tp)
    return found[1:]


@dataclass
class Candidate:
    """One layout `strategy.tp: auto` weighs: its name in the estimate, its data-parallel flavour,
    tp, and the bytes one rank would hold."""

    key: str
    name: str
    tp: int
    bytes: int


def weigh(
    cfg: Any,
    world_size: int,
    model: nn.Module,
    blocks: Any,
    plan: Any,
    estimate: dict[str, int],
    per_byte: int,
    device: tuple[int, float],
    activations: Callable[[Callable[[nn.Module], None]], int] | None = None,
) -> tuple[Candidate, dict[str, int], str]:
    """(the layout chosen, every candidate's bytes per rank, the reason), for `strategy.tp: auto`:
    the simplest whose bytes fit the device's (bytes, usable share): DDP (with `strategy.name:
    auto`), FSDP, then FSDP x TP by growing tp (`tp_candidates`, with a plan); else the one that
    needs least. FSDP's and TP's parameter bytes are measured (`parameter_bytes`) and taken
    `per_byte` times (parameters, gradients, optimizer state); plus two gathered blocks, divided
    by tp; plus the activations: the estimate's meta forward's, and for a TP candidate
    `activations(lay_out)`'s, one rank's measured on a meta copy with the plan laid out
    (sequence parallelism as the config says): what the layout saves, and nothing it does not.
    Where that cannot be measured (no example, a forward the plan breaks), the whole model's.
    Collective."""
    from raylane.loop.distributed.blocks import blocks_of
    from raylane.loop.distributed.devices import local_world_size, size_text

    s = cfg.strategy
    acts = estimate["activations"]
    largest = max(
        (sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks_of(model, blocks)), default=0
    )
    tps = tp_candidates(cfg, world_size, local_world_size(default=world_size)) if plan is not None else []
    if tps:  # the degrees that split every attention's heads whole (raylane.loop.distributed.heads)
        from raylane.loop.distributed.heads import heads_problem
        from raylane.loop.distributed.tensor_parallel import plan_for

        rules = plan_for(model, plan, sequence_parallel=s.sequence_parallel)
        tps = [tp for tp in tps if heads_problem(model, rules, tp) is None]
    options = [Candidate("ddp", "ddp", 1, estimate["ddp"])] if s.name == "auto" else []
    measured: dict[str, int] = {}
    with fake_work():  # in the process that trains next: see fake_work
        for tp in [1, *tps]:  # FSDP2 over the rest of the world (its shards, as measured)
            layout = Layout("fsdp", dp_shard=world_size // tp, tp=tp, sequence_parallel=s.sequence_parallel)
            mesh = fake_mesh(layout)
            held = parameter_bytes(model, blocks, layout, plan, mesh=mesh)
            mine = acts
            if tp > 1 and activations is not None:
                mine = measured[f"activations_tp{tp}"] = _rank_activations(activations, plan, mesh, s, acts)
            need = held * per_byte + mine + 2 * largest // tp
            options.append(Candidate("fsdp" if tp == 1 else f"fsdp_tp{tp}", "fsdp", tp, need))
    budget, share = device
    chosen = next((c for c in options if c.bytes <= share * budget), None)
    needs = ", ".join(f"{c.key.replace('_', '×').upper()} ~{size_text(c.bytes)}" for c in options)
    why = f"tp auto: per rank {needs}, of {size_text(budget)} per device ({share:.0%} usable)"
    if chosen is None:
        chosen, why = min(options, key=lambda c: c.bytes), f"{why}; none fits: the smallest"
    return chosen, {"activations": acts, **measured, "device": budget, **{c.key: c.bytes for c in options}}, why


def _rank_activations(activations: Callable, plan: Any, mesh: Any, s: Any, whole: int) -> int:
    """One rank's activations with the plan laid out over `mesh`'s tp ranks; `whole` where the
    forward does not run so (said at debug level: the run itself will say why)."""
    from raylane.loop.distributed.tensor_parallel import apply_plan

    def lay_out(meta: nn.Module) -> None:
        # the head's logits gathered: the estimate's loss runs outside loss_parallel's context,
        # so loss parallelism's split logits are not counted as saved (never a saving not measured)
        apply_plan(meta, plan, mesh["tp"], sequence_parallel=s.sequence_parallel)

    try:
        return activations(lay_out)
    except Exception as exc:  # noqa: BLE001 - a forward the plan breaks: nothing saved is counted
        log.debug("tp auto: activations under tp %d not measured (%s: %s)", mesh["tp"].size(), type(exc).__name__, exc)
        return whole
