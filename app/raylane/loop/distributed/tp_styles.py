"""A tensor-parallel plan's styles given by name: `"colwise"`, `"rowwise"`, ..., the notation of
transformers' plans (`base_model_tp_plan`) and of `raylane check --plan`'s printout, read as
torch's ParallelStyles of the same split, so that a pipeline's `tp_plan` may say
`{"blocks.*.attn.q_proj": "colwise"}` as well as `ColwiseParallel()`.

Accepted: the names whose split torch's own styles make exactly (STYLES: transformers'
`colwise`, `rowwise`, their `_rep`/`_gather_output`/`_split_input` variants, the embedding's,
`sequence_parallel`) and `replicate` (held whole on every rank, as any module no rule names).
Refused, in one line naming the rule: transformers' styles that are its own modules' code and not
a layout torch's styles can make (`local_colwise` keeps plain tensors and leaves the all-reduce to
the model, `packed_*` splits fused projections, `moe_*`, `mla_kv_a_proj`, ...: taken as plain
`colwise` they would train wrong without a word), a misspelt name (the nearest named), and any
value that is neither a name nor a ParallelStyle (the class itself, `ColwiseParallel`, unmade)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from raylane.errors import ConfigError

# name -> (torch's style, its keyword layouts: "in"/"out" Replicate where the name says so), as
# transformers registers them (transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES).
STYLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "colwise": ("colwise", ()),
    "colwise_rep": ("colwise", ("out",)),
    "colwise_gather_output": ("colwise", ("out",)),
    "rowwise": ("rowwise", ()),
    "rowwise_rep": ("rowwise", ("in",)),
    "rowwise_split_input": ("rowwise", ("in",)),
    "embedding_rowwise": ("rowwise", ("in",)),  # an embedding split by vocabulary rows
    "embedding_colwise": ("colwise", ("out",)),  # an embedding split by width, gathered
    "sequence_parallel": ("sequence", ()),
    "replicate": ("whole", ()),
}

# transformers' styles with no torch layout of the same arithmetic: each refused with its reason.
_NOT_TORCH = {
    "local": "its module computes on its own shard and gathers itself",
    "local_colwise": "it keeps plain tensors and leaves the gather to the model's own code",
    "local_rowwise": "it keeps plain tensors and leaves the all-reduce to the model's own code",
    "local_packed_rowwise": "it splits a fused projection and leaves the all-reduce to the model's own code",
    "local_params": "it keeps plain tensors and leaves the gather to the model's own code",
    "gather": "its module gathers what local styles left split, in transformers' own code",
    "isolated": "its module computes alone on each rank, in transformers' own code",
    "packed_colwise": "it splits a fused projection (gate and up in one weight) by each part",
    "packed_rowwise": "it splits a fused projection by each part",
    "mla_kv_a_proj": "it splits part of a fused projection",
    "all_reduce": "it is an all-reduce of transformers' own modules",
    "replicated_with_grad_allreduce": "it is an all-reduce of transformers' own modules",
    "moe_tp_experts": "it splits a mixture of experts' stacked weights",
    "moe_identity_expert": "it is transformers' expert parallelism",
    "ep_router": "it is transformers' expert parallelism",
    "grouped_gemm": "it is transformers' expert parallelism",
}


def resolve_style(value: Any, key: str) -> Any:
    """`value` as torch's ParallelStyle: a ParallelStyle as it is, a name of STYLES as its torch
    style. ConfigError, one line starting with `key` (the rule: `Pipeline.tp_plan['lm_head']`),
    for anything else, listing the names taken."""
    if isinstance(value, ParallelStyle):
        return value
    if isinstance(value, str):
        if value in STYLES:
            return _made(value)
        if value in _NOT_TORCH:
            raise ConfigError(
                f"{key} = {value!r}: a transformers style raylane does not lay out with torch's styles "
                f"({_NOT_TORCH[value]}); give a style of {_allowed()}, or a torch ParallelStyle"
            )
        near = difflib.get_close_matches(value, STYLES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{key} = {value!r}: no such style{hint}; give one of {_allowed()}, or a torch ParallelStyle")
    if isinstance(value, type) and issubclass(value, ParallelStyle):
        raise ConfigError(f"{key} = {value.__name__}: the class, not a style; give {value.__name__}() (called)")
    raise ConfigError(
        f"{key} = {_shown(value)}: not a style; give a torch ParallelStyle (ColwiseParallel(), ...) or one of "
        f"{_allowed()}"
    )


def resolve_rules(rules: Mapping[str, Any], owner: str = "Pipeline.tp_plan") -> dict[str, Any]:
    """Every rule of a plan {pattern: style} with its style resolved (`resolve_style`), each
    named `owner['pattern']`."""
    return {pattern: resolve_style(style, f"{owner}[{pattern!r}]") for pattern, style in rules.items()}


def style_name(style: Any) -> str | None:
    """The name a resolved style was given (`replicate` for Whole), None for one made in code."""
    return getattr(style, "raylane_name", None)


def _made(name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    kind, replicated = STYLES[name]
    style: Any
    if kind == "colwise":
        style = ColwiseParallel(output_layouts=Replicate()) if "out" in replicated else ColwiseParallel()
    elif kind == "rowwise":
        style = RowwiseParallel(input_layouts=Replicate()) if "in" in replicated else RowwiseParallel()
    elif kind == "sequence":
        # torch's default keeps the output a DTensor, which carries its Shard(1) to the next style
        # (transformers' use_local_output=True hands a bare shard on, read as whole by a colwise).
        style = SequenceParallel()
    else:
        style = Whole()
    style.raylane_name = name
    return style


class Whole(ParallelStyle):
    """`replicate`: the module held whole on every rank of the group, as a module no rule names."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return module


def _allowed() -> str:
    return ", ".join(repr(n) for n in STYLES)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"
