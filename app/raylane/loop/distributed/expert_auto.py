"""`strategy.ep: auto`: the expert-parallel degree the memory estimate picks on the ranks, as
`strategy.tp: auto` picks its degree (raylane.loop.distributed.parallelize): the smallest degree
that divides the data-parallel ranks and every experts module's experts at which a rank's share
fits its device, 1 where every expert fits on every rank. A model without experts, or a pipeline
without an ep_plan, gets 1 and says why: `auto` asks for expert parallelism where it helps, and a
dense model is not a mistake.

What a degree d saves, from estimate_memory's figures (which hold every expert on every rank):
under DDP, each rank keeps experts / d of the experts' parameters, gradients and optimizer state,
and the experts leave DDP's gradient buckets; under FSDP, whose state is sharded over every rank
whatever d, the gathered experts module is experts / d of its experts (the gathered-block term).
Nothing is chosen that the layout checks would refuse: tp, pp, HSDP's replicas, replica groups,
elastic runs and `name: auto` are refused beside `auto` as beside a number
(raylane.config.strategy, raylane.layout_checks)."""

from __future__ import annotations

from typing import Any

from torch import nn

from raylane.config import BaseConfig
from raylane.loop.distributed.devices import (
    AUTO_MARGIN,
    OPTIMIZER_STATES,
    device_memory_bytes,
    local_world_size,
    size_text,
)
from raylane.loop.distributed.expert_plan import experts_of, resolve_ep_plan


def choose_ep(
    model: nn.Module, plan: Any, cfg: BaseConfig, world_size: int, name: str, estimate: dict[str, int], device: Any
) -> tuple[int, str]:
    """(the degree, the line that says why) for `model` on `world_size` data-parallel ranks held
    as `name` (ddp or fsdp); `estimate`: estimate_memory's figures for this model and world."""
    needs = expert_needs(model, plan, cfg, world_size, name, estimate)
    if isinstance(needs, str):
        return 1, f"strategy.ep: auto → 1 ({needs})"
    budget = device_memory_bytes(device, cfg.scaling.device_memory_gb, local_world_size())
    fits = [d for d, need in needs.items() if need <= AUTO_MARGIN * budget]
    ep = fits[0] if fits else max(needs)
    figures = f"~{size_text(needs[1])} per rank at ep 1" + (f", ~{size_text(needs[ep])} at ep {ep}" if ep > 1 else "")
    verdict = "" if fits else f"; none of ep {', '.join(map(str, needs))} fits: the largest"
    held = "DDP" if name == "ddp" else "FSDP"
    return ep, (
        f"strategy.ep: auto → {ep}: {held} needs {figures}, of {size_text(budget)} per device "
        f"({AUTO_MARGIN:.0%} usable){verdict}"
    )


def expert_needs(
    model: nn.Module, plan: Any, cfg: BaseConfig, world_size: int, name: str, estimate: dict[str, int]
) -> dict[int, int] | str:
    """Each degree `ep: auto` may choose (ascending) -> a rank's estimated bytes at it; or why
    only 1 is (one rank, no plan, no experts)."""
    if world_size == 1:
        return "one rank"
    if plan is None:
        return "the pipeline gives no ep_plan"
    try:
        paths = resolve_ep_plan(model, plan)
    except ValueError as exc:  # a dense model's empty plan, a pattern naming nothing
        return str(exc).split(";")[0]
    counts = [experts_of(model.get_submodule(p), p) for p in paths]
    sizes = [sum(t.numel() * t.element_size() for t in model.get_submodule(p).parameters()) for p in paths]
    o = cfg.optim
    per_byte = 2 + OPTIMIZER_STATES.get(o.name, 1 if o.momentum else 0)  # parameters, gradients, states
    buckets = 0 if cfg.strategy.gradient_as_bucket_view else sum(sizes)

    def need(d: int) -> int:
        saved = 1 - 1 / d
        if name == "ddp":
            return estimate["ddp"] - int(sum(sizes) * per_byte * saved) - (buckets if d > 1 else 0)
        return estimate["fsdp"] - int(2 * max(sizes) * saved)

    return {d: need(d) for d in range(1, world_size + 1) if world_size % d == 0 and all(c % d == 0 for c in counts)}
