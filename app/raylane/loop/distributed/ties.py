"""Parameters held under several names (tied embeddings: a head sharing the embedding's
weight), which what rebuilds a model's parameters splits apart: torch's `parallelize_module`
(raylane.loop.distributed.tensor_parallel) and `to_empty` (raylane.loop.distributed.fsdp.
materialize) each give every name a Parameter of its own; `retie` ties them again."""

from __future__ import annotations

from torch import nn


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """The names under which one parameter is held more than once (tied embeddings)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(model: nn.Module, ties: list[list[str]]) -> None:
    """Every name of each group holds its first name's parameter again. ValueError when a plan
    laid the tied names out differently (one parameter cannot have two layouts)."""
    for names in ties:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            other = model.get_parameter(name)
            if other is first:
                continue
            if getattr(other, "placements", None) != getattr(first, "placements", None):
                raise ValueError(
                    f"Pipeline.tp_plan: {names[0]!r} and {name!r} are one tied parameter, which the plan lays "
                    f"out as {getattr(first, 'placements', 'whole')} and {getattr(other, 'placements', 'whole')}; "
                    "give both the same sharding"
                )
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
