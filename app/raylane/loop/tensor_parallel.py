"""Tensor parallelism from a pipeline's plan (`Pipeline.tp_plan`): which of the model's modules
torch's ParallelStyles split over the ranks of a tensor-parallel group, applied by
`parallelize_module` before FSDP2 (torchtitan's order), with what that function leaves wrong put
right: tied parameters come back untied (trap b of issue 49's study), so they are tied again."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fnmatch import fnmatch
from typing import Any

from torch import nn

# A pipeline's plan: {module path: ParallelStyle}, `*` standing for one name in the path (a
# block's index), as torch's parallelize_module takes it; or plan(model, sequence_parallel) -> that.
TpPlan = Mapping[str, Any] | Callable[[nn.Module, bool], Mapping[str, Any]]


def plan_for(model: nn.Module, plan: TpPlan, *, sequence_parallel: bool) -> dict[str, Any]:
    """The plan as {pattern: ParallelStyle}; ValueError naming the first rule that names no module
    (a misspelt path would otherwise leave its layers whole on every rank, silently)."""
    rules = dict(plan(model, sequence_parallel) if callable(plan) else plan)
    names = [name.split(".") for name, _ in model.named_modules() if name]
    for pattern in rules:
        atoms = pattern.split(".")
        if not any(len(n) == len(atoms) and all(map(fnmatch, n, atoms)) for n in names):
            raise ValueError(f"Pipeline.tp_plan: {pattern!r} names no module of {type(model).__name__}")
    return rules


def apply_plan(
    model: nn.Module, plan: TpPlan, tp_mesh: Any, *, sequence_parallel: bool, loss_parallel: bool = False
) -> None:
    """In place: the plan on the model, over `tp_mesh`, and its ties kept. `loss_parallel`: the
    head's logits left split over the vocabulary (`with_split_head`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    rules = plan_for(model, plan, sequence_parallel=sequence_parallel)
    if loss_parallel:
        rules = with_split_head(rules)
    ties = shared_parameters(model)
    parallelize_module(model, tp_mesh, rules)
    # parallelize_module gives each module a Parameter of its own: a head tied to the embedding
    # would then train apart from it (the study's step-0 gradients 99% off).
    retie(model, ties)


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


def with_split_head(rules: dict[str, Any]) -> dict[str, Any]:
    """The plan with its head's output left split over the vocabulary, as a DTensor, for the
    cross-entropy under torch's loss_parallel (torchtitan's loss parallel). The head is the plan's
    one column-wise rule that gathers its output (`output_layouts=Replicate()`, as a plan without
    loss parallelism gives it, and transformers' `colwise_rep`); ValueError when there is none or
    more than one."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    heads = [
        name
        for name, style in rules.items()
        if isinstance(style, ColwiseParallel) and tuple(style.output_layouts) == (Replicate(),)
    ]
    if len(heads) != 1:
        raise ValueError(
            "strategy.loss_parallel = True: the pipeline's tp_plan needs exactly one head, a ColwiseParallel "
            f"rule with output_layouts=Replicate() (it has {heads or 'none'})"
        )
    head = rules[heads[0]]
    split = ColwiseParallel(input_layouts=head.input_layouts[0], output_layouts=Shard(-1), use_local_output=False)
    return {**rules, heads[0]: split}


def gather_when_evaluating(model: nn.Module) -> None:
    """In evaluation (and any forward in eval mode), the split logits of loss parallelism come out
    whole, so that eval_sums, metrics and exported models see plain tensors; training keeps them
    split for the loss."""
    from torch.distributed.tensor import DTensor

    def whole(module: nn.Module, args: Any, output: Any) -> Any:
        if not module.training and isinstance(output, DTensor):
            return output.full_tensor()
        return None

    model.register_forward_hook(whole)


def loss_context(loss_parallel: bool) -> Any:
    """The context a training step's forward, loss and backward run in: torch's loss_parallel,
    whose cross-entropy takes vocabulary-split logits (backward included), or none."""
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as context

        return context()
    import contextlib

    return contextlib.nullcontext()
