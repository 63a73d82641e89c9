"""Tensor parallelism from a pipeline's plan (`Pipeline.tp_plan`): which of the model's modules
torch's ParallelStyles split over the ranks of a tensor-parallel group, applied by
`parallelize_module` before FSDP2 (torchtitan's order), with what that function leaves wrong put
right: tied parameters come back untied (trap b of issue 49's study), so they are tied again; and
an attention's head count, held in an attribute its forward views q, k and v by
(`view(B, T, self.n_heads, self.head_dim)`), becomes the rank's own (`local_heads`).

Sequence parallelism lays out what lies between the split layers (the norms, the residual stream,
the embeddings' outputs, the head's input), which only the model's author knows: it needs a plan
that is a function of the flag, `tp_plan(model, sequence_parallel)`, that lays out something else
with it (`plan_for` refuses a dict plan, or a function that ignores the flag).

`lay_out_tensor_parallel` is a run's layout step under `strategy.tp` (without pipeline stages:
raylane.loop.distributed.pipeline_parallel lays out each stage)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn

from raylane.config import BaseConfig
from raylane.loop.distributed.fsdp import Strategy, fully_shard, on_meta, prepare_blocks

# The attributes that hold an attention module's head count (nanoGPT's, Llama's reference code's,
# transformers' names): the checks' (raylane.loop.distributed.heads) and local_heads' alike.
from raylane.loop.distributed.heads import HEAD_COUNTS
from raylane.loop.distributed.ties import retie, shared_parameters

# A pipeline's plan: {module path: ParallelStyle}, `*` standing for one name in the path (a
# block's index), as torch's parallelize_module takes it; or plan(model, sequence_parallel) -> that.
TpPlan = Mapping[str, Any] | Callable[[nn.Module, bool], Mapping[str, Any]]


def plan_for(model: nn.Module, plan: TpPlan, *, sequence_parallel: bool) -> dict[str, Any]:
    """The plan as {pattern: ParallelStyle}, styles given by name (`"colwise"`, transformers'
    notation) made torch's (raylane.loop.distributed.tp_styles); ValueError naming the first rule that names
    no module (a misspelt path would otherwise leave its layers whole on every rank, silently) or
    whose style is none, and for sequence parallelism with a plan that cannot lay it out
    (`check_sequence_parallel`)."""
    from raylane.loop.distributed.tp_styles import resolve_rules

    if sequence_parallel:
        check_sequence_parallel(model, plan)
    rules = dict(plan(model, sequence_parallel) if callable(plan) else plan)
    names = [name.split(".") for name, _ in model.named_modules() if name]
    for pattern in rules:
        atoms = pattern.split(".")
        if not any(len(n) == len(atoms) and all(map(fnmatch, n, atoms)) for n in names):
            raise ValueError(f"Pipeline.tp_plan: {pattern!r} names no module of {type(model).__name__}")
    return resolve_rules(rules)


def check_sequence_parallel(model: nn.Module, plan: TpPlan) -> None:
    """ValueError, one line naming strategy.sequence_parallel, unless `plan` lays the model out
    differently with sequence parallelism than without: a dict plan is the same either way (the
    flag would do nothing while the run is named `+sp`), and so is a function that ignores it."""
    what = (
        "sequence parallelism splits what lies between the split layers (the norms, the residual stream, the "
        "embeddings' outputs and the head's input) by tokens, which only a plan written for it lays out"
    )
    fix = (
        "give the pipeline tp_plan(model, sequence_parallel) -> plan, laying those out when the flag is true "
        "(the gpt pipeline's tp_plan; docs/strategies.md, Sequence parallelism), or set "
        "strategy.sequence_parallel: false"
    )
    if not callable(plan):
        raise ValueError(f"strategy.sequence_parallel = True: the pipeline's tp_plan is a dict; {what}: {fix}")
    if _same_plan(dict(plan(model, True)), dict(plan(model, False))):
        raise ValueError(
            f"strategy.sequence_parallel = True: the pipeline's tp_plan(model, sequence_parallel) gives the same "
            f"plan either way; {what}: {fix}"
        )


def _same_plan(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def shown(style: Any) -> Any:
        return (type(style), repr(sorted(vars(style).items())) if hasattr(style, "__dict__") else repr(style))

    return a.keys() == b.keys() and all(shown(a[k]) == shown(b[k]) for k in a)


def apply_plan(
    model: nn.Module, plan: TpPlan, tp_mesh: Any, *, sequence_parallel: bool, loss_parallel: bool = False
) -> None:
    """In place: the plan on the model, over `tp_mesh`, and its ties kept. `loss_parallel`: the
    head's logits left split over the vocabulary (`with_split_head`)."""
    rules = plan_for(model, plan, sequence_parallel=sequence_parallel)
    if loss_parallel:
        rules = with_split_head(rules)
    apply_rules(model, rules, tp_mesh)


def apply_rules(model: nn.Module, rules: dict[str, Any], tp_mesh: Any) -> None:
    """In place: `rules` ({pattern: ParallelStyle}) on the model over `tp_mesh`, its ties kept and
    its attentions' head counts made the rank's own (`local_heads`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    ties = shared_parameters(model)
    parallelize_module(model, tp_mesh, rules)
    # parallelize_module gives each module a Parameter of its own: a head tied to the embedding
    # would then train apart from it (the study's step-0 gradients 99% off).
    retie(model, ties)
    local_heads(model, rules, tp_mesh.size())


def local_heads(model: nn.Module, rules: dict[str, Any], tp: int) -> list[str]:
    """In place: each module with a child the plan splits by columns, leaving its output split (an
    attention's q, k or v projection), has its own head-count attributes (HEAD_COUNTS, integers;
    never a shared `config`'s, which transformers' attentions read and view by -1 heads) divided by `tp`, as that rank's share of the heads: a forward written `view(B, T,
    self.n_heads, self.head_dim)` then views the rank's own q, k and v. Returns the
    `module.attribute` names changed; ValueError when `tp` does not divide one. A module is
    changed once (a plan applied again leaves it)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    split = {
        name
        for name, _ in model.named_modules()
        for pattern, style in rules.items()
        if isinstance(style, ColwiseParallel) and isinstance(style.output_layouts[0], Shard) and _matches(name, pattern)
    }
    changed = []
    for name, module in model.named_modules():
        if getattr(module, "_raylane_local_heads", False):
            continue
        if not any(f"{name}.{child}".lstrip(".") in split for child in module._modules):
            continue
        for attr in HEAD_COUNTS:
            value = module.__dict__.get(attr)  # a plain attribute, not a submodule or parameter
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if value % tp:
                raise ValueError(
                    f"strategy.tp = {tp}: does not divide {name or type(model).__name__}.{attr} = {value}, the heads "
                    "each rank takes a share of"
                )
            setattr(module, attr, value // tp)
            changed.append(f"{name}.{attr}".lstrip("."))
            module._raylane_local_heads = True
    return changed


def _matches(name: str, pattern: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(map(fnmatch, parts, atoms))


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


def lay_out_tensor_parallel(
    model: nn.Module, blocks: list[nn.Module], cfg: BaseConfig, device: torch.device, strategy: Strategy, plan: Any
) -> nn.Module:
    """The plan on each tensor-parallel group of the strategy's mesh, then recompute and compile,
    then FSDP2 over the data-parallel ranks: over one rank too, so that every parameter is a
    DTensor (torch's fused optimizers and its clipping take no plain tensors beside DTensors)."""
    if plan is None:
        raise ValueError(
            f"strategy.tp = {strategy.tp}: the pipeline gives no tp_plan (which layers tensor parallelism "
            "splits): give its Pipeline a tp_plan (docs/strategies.md, Tensor parallelism)"
        )
    layout = strategy.layout
    mesh = layout.device_mesh(device.type)
    if not on_meta(model):
        model = model.to(device)
    apply_plan(model, plan, mesh["tp"], sequence_parallel=layout.sequence_parallel, loss_parallel=layout.loss_parallel)
    if layout.loss_parallel:
        gather_when_evaluating(model)
    prepare_blocks(model, cfg, blocks)
    return fully_shard(model, blocks, cfg, device, strategy, layout.fsdp_mesh(mesh))
