"""A pipeline's expert plan (Pipeline.ep_plan) read against its model: which modules are the
experts that `strategy.ep` splits over ranks, each checked to be one that can be split.

An experts module holds every expert's weights in each of its parameters, the experts along the
leading dimension (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`: transformers 5's fused
experts, torchtitan's GroupedExperts), and its forward is `experts(hidden [T, H], top_k_index
[T, k], top_k_weights [T, k]) -> [T, H]`. A ModuleList of experts (transformers 4's) is not one:
its weights are its children's, one expert each, and there is no leading dimension to cut.

Checked before launch on the model built on the meta device (raylane.layout_checks.check_plan),
and again where the run lays the experts out (raylane.loop.distributed.parallelize): a pattern
that names nothing would otherwise leave every expert on every rank, silently. Shapes only: no
process group, no memory."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from fnmatch import fnmatch

from torch import nn

# A Pipeline.ep_plan: module path patterns (`*` one name of a path), or model -> those.
EpPlan = Sequence[str] | Callable[[nn.Module], Sequence[str]]


def resolve_ep_plan(model: nn.Module, plan: EpPlan, *, ep: int | None = None) -> list[str]:
    """The paths of the experts modules `plan` names in `model`, in the model's order: each
    pattern (`"layers.*.moe.experts"`, `*` standing for one name of the path) must name at least
    one module, and each module named must hold its experts along its parameters' leading
    dimension (`experts_of`); with `ep`, a number of experts that `ep` divides. ValueError, one
    line naming the pattern or the module, otherwise (an empty plan included: a dense model's)."""
    patterns = plan(model) if callable(plan) else plan
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    cls = type(model).__name__
    if not patterns:
        raise ValueError(
            f"Pipeline.ep_plan names no experts module of {cls} (the plan is empty: a dense model has no experts to "
            "split); use strategy.ep: 1"
        )
    names = [name for name, _ in model.named_modules() if name]
    found: set[str] = set()
    for pattern in patterns:
        hits = [name for name in names if _matches(name, pattern)]
        if not hits:
            raise ValueError(f"Pipeline.ep_plan: {pattern!r} names no module of {cls}")
        found.update(hits)
    paths = [name for name in names if name in found]
    for path in paths:
        count = experts_of(model.get_submodule(path), path)
        if ep is not None and count % ep:
            raise ValueError(
                f"Pipeline.ep_plan: {path} has {count} experts, which {ep} ranks cannot hold in equal shares (each "
                "of the ep ranks holds experts / ep)"
            )
    return paths


def experts_of(module: nn.Module, path: str) -> int:
    """How many experts `module` (at `path`) holds: its `num_experts` where it says, else the
    leading dimension all its parameters share. ValueError, one line naming the module, where
    it is not an experts module: a child's parameters (a ModuleList of experts, a whole MoE
    block), no parameters, a forward that does not take the router's choice (a router), or a
    parameter without that leading dimension."""
    own = dict(module.named_parameters(recurse=False))
    cls = type(module).__name__
    nested = [name for name, _ in module.named_parameters() if name not in own]
    if nested:
        raise ValueError(
            f"Pipeline.ep_plan: {path} ({cls}) holds {path}.{nested[0]}, a child's parameter: an experts module "
            "holds every expert's weights in its own parameters, the experts leading ([experts, ...]); a "
            "ModuleList of experts is not one"
        )
    if not own:
        raise ValueError(
            f"Pipeline.ep_plan: {path} ({cls}) has no parameters, so no experts to split; name the module that "
            "holds the experts' weights"
        )
    _check_forward(module, path)
    declared = getattr(module, "num_experts", None)
    leading = {name: (p.shape[0] if p.dim() else None) for name, p in own.items()}
    if isinstance(declared, int) and not isinstance(declared, bool):
        count, why = declared, "its num_experts"
    elif len(set(leading.values())) == 1 and None not in leading.values():
        return next(iter(leading.values()))  # type: ignore[return-value]
    else:
        shapes = ", ".join(f"{name} {tuple(p.shape)}" for name, p in own.items())
        raise ValueError(
            f"Pipeline.ep_plan: {path} ({cls}) is not an experts module: its parameters share no leading "
            f"dimension ({shapes}), where each holds every expert's weights, the experts leading"
        )
    for name, p in own.items():
        if leading[name] != count:
            raise ValueError(
                f"Pipeline.ep_plan: {path}.{name} has shape {tuple(p.shape)}, no leading dimension of {count} "
                f"({why}): each parameter of an experts module holds every expert's weights, the experts leading"
            )
    return count


def _check_forward(module: nn.Module, path: str) -> None:
    """A forward that takes the router's choice beside the tokens (a router, a Linear whose weight
    also leads with the number of experts, or a whole MoE block, takes the tokens alone)."""
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3:
        raise ValueError(
            f"Pipeline.ep_plan: {path} ({type(module).__name__}) is not an experts module: its forward takes "
            f"({', '.join(positional)}), not (hidden, top_k_index, top_k_weights), the tokens and the router's choice"
        )


def _matches(name: str, pattern: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(map(fnmatch, parts, atoms))
