"""Tensor parallelism for Hugging Face models: the model's own plan (transformers' `tp_plan`, from
its config's `base_model_tp_plan` and its class's `_tp_plan`: `model.layers.*.self_attn.q_proj:
colwise`, ...) as torch's ParallelStyles, which raylane applies on its own mesh
(raylane.loop.distributed.tensor_parallel.apply_plan) like any pipeline's plan. transformers builds no mesh
and no process group here: its `from_pretrained(tp_plan="auto")` makes its own mesh of the whole
world, which cannot hold data-parallel ranks beside the tensor-parallel ones (issue 49's study, 3.2 f).

A LoRA adapter (peft) is planned with the layer it adapts, by the rule of ezpz#208 that the study
checked against one process: a column-split base splits `lora_B` by columns too and keeps
`lora_A` whole on every rank (its input is the base's, whole); a row-split base splits `lora_A`
by rows (its input is the base's, split) and keeps `lora_B` whole. The adapter's output then has
the base's layout, and the two add up on every rank."""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any

# transformers' style names (transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES) ->
# (torch's ParallelStyle, its keyword layouts) of the same split: "out" is the output's layout,
# "in" the input's, R for whole (Replicate). An embedding takes the Linear's styles.
_STYLES: dict[str, tuple[str, dict[str, str]]] = {
    "colwise": ("colwise", {}),
    "colwise_gather_output": ("colwise", {"out": "R"}),
    "colwise_rep": ("colwise", {"out": "R"}),
    "rowwise": ("rowwise", {}),
    "rowwise_split_input": ("rowwise", {"in": "R"}),
    "rowwise_rep": ("rowwise", {"in": "R"}),
    "embedding_rowwise": ("rowwise", {"in": "R"}),
    "embedding_colwise": ("colwise", {"out": "R"}),
}
# Left out of the plan: each rank of the group holds the whole module, as every unplanned one.
_WHOLE = {"replicate"}
# A mixture of experts' fused experts (transformers' `moe_tp_experts`, with `packed_colwise`
# gate_up_proj and a rowwise 3-D down_proj under it): left whole on every rank of the
# tensor-parallel group, as the router beside them, so each rank runs the block on the whole
# hidden state it holds after attention; FSDP still shards them over the data-parallel ranks.
# torch has no packed column split (gate's and up's halves each split), and splitting experts
# across ranks is expert parallelism's (issue 65), not tensor parallelism's.
_WHOLE_EXPERTS = "moe_tp_experts"


def hf_plan(pretrained: Any) -> dict[str, str]:
    """The transformers model's own plan, {module path pattern: style name} from its root: the
    class's `_tp_plan` and its config's `base_model_tp_plan` under the base model's prefix
    (transformers' `model.tp_plan` merges the same). Empty when it has none."""
    plan = getattr(pretrained, "tp_plan", None)
    if isinstance(plan, dict):
        return dict(plan)
    prefix = getattr(pretrained, "base_model_prefix", "")
    base = getattr(getattr(pretrained, "config", None), "base_model_tp_plan", None) or {}
    own = dict(getattr(type(pretrained), "_tp_plan", None) or {})
    inner = bool(prefix) and hasattr(pretrained, prefix)  # a head model holds its base under the prefix
    return own | {(f"{prefix}.{k}" if inner else k): v for k, v in base.items()}


def pretrained_of(model: Any) -> tuple[str, Any]:
    """(its path in `model`, the transformers model): `model` itself, or the base under a peft
    wrapper (`base_model.model`); ValueError when there is none."""
    from transformers import PreTrainedModel

    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return name, module
    raise ValueError(
        f"{type(model).__name__} holds no transformers model: raylane.hf.tensor_parallel has no plan for it"
    )


def tp_plan(model: Any, sequence_parallel: bool = False) -> dict[str, Any]:
    """The Pipeline.tp_plan of a transformers model (or a peft model around one): its own plan
    as torch's ParallelStyles, under the names `model` holds it by, a LoRA-adapted layer's
    base and adapter planned together. ValueError (one line) for a model without a plan, a
    style torch has no counterpart of here, an adapted layer laid out other than by rows or
    columns, and sequence parallelism (transformers' plans lay out no norms for it)."""
    prefix, pretrained = pretrained_of(model)
    cls = type(pretrained).__name__
    if sequence_parallel:
        raise ValueError(
            f"strategy.sequence_parallel = True: {cls}'s plan (transformers') lays out no sequence-parallel "
            "norms; use strategy.sequence_parallel: false"
        )
    plan = hf_plan(pretrained)
    if not plan:
        raise ValueError(
            f"{cls} has no tensor-parallel plan (transformers declares none for a {pretrained.config.model_type!r} "
            "model: no base_model_tp_plan); use strategy.tp: 1, or a pipeline of your own with a tp_plan"
        )
    modules = dict(model.named_modules())
    rules: dict[str, Any] = {}
    experts = [pattern for pattern, style in plan.items() if style == _WHOLE_EXPERTS]
    for pattern, style in plan.items():
        if style in _WHOLE or any(pattern == e or pattern.startswith(f"{e}.") for e in experts):
            continue
        if style not in _STYLES:
            raise ValueError(
                f"{cls}'s plan lays out {pattern!r} as {style!r}, a transformers style raylane has no torch "
                f"counterpart of (it has {', '.join(sorted(_STYLES))}); use strategy.tp: 1"
            )
        path = f"{prefix}.{pattern}" if prefix else pattern
        found = [name for name in modules if _matches(name, path)]
        adapted = [name for name in found if _is_lora(modules[name])]
        if not adapted:
            if found:  # a rule for a module this variant lacks is no rule (transformers skips it too)
                rules[path] = torch_style(style)
            continue
        for name in found:  # an adapted layer's rules are its own, each by its full name
            rules |= _adapted(name, modules[name], style) if name in adapted else {name: torch_style(style)}
    if not rules:
        raise ValueError(f"{cls}'s plan (transformers') names none of its modules: {', '.join(plan)}")
    return rules


def torch_style(name: str) -> Any:
    """torch's ParallelStyle for the transformers style `name` (one of _STYLES)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    kind, layouts = _STYLES[name]
    if kind == "colwise":
        return ColwiseParallel(output_layouts=Replicate()) if layouts.get("out") else ColwiseParallel()
    return RowwiseParallel(input_layouts=Replicate()) if layouts.get("in") else RowwiseParallel()


def _adapted(name: str, module: Any, style: str) -> dict[str, Any]:
    """A LoRA layer's rules: its base as the plan says, the adapter's matrix on the split side
    alike (lora_B beside a column split, lora_A beside a row split), the other one whole."""
    kind = _STYLES[style][0]
    if not hasattr(module, "base_layer") or any(True for _ in getattr(module, "lora_embedding_A", {})):
        raise ValueError(f"lora.target_modules: {name} is laid out {style!r}, which raylane splits no adapter beside")
    side = "lora_B" if kind == "colwise" else "lora_A"
    adapters = list(getattr(module, side))
    return {f"{name}.base_layer": torch_style(style), **{f"{name}.{side}.{a}": torch_style(style) for a in adapters}}


def _is_lora(module: Any) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft: no adapter
        return False
    return isinstance(module, LoraLayer)


def _matches(name: str, pattern: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(map(fnmatch, parts, atoms))


def check_tp(model: Any, tp: int, *, sequence_parallel: bool = False) -> dict[str, Any]:
    """Before launch: the plan of `model` (built on the meta device) and that `tp` splits it
    into whole attention heads (a rank's share of q, k and v is viewed as whole heads). Returns
    the plan; ValueError naming strategy.tp otherwise."""
    _, pretrained = pretrained_of(model)
    if sequence_parallel:
        return tp_plan(model, sequence_parallel)  # its own line, naming strategy.sequence_parallel
    text = pretrained.config.get_text_config(decoder=True)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, key, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(
                f"strategy.tp = {tp}: does not divide the {heads} {key.replace('num_', '').replace('_', ' ')} of "
                f"{type(pretrained).__name__} (config.{key}), which each rank takes a share of"
            )
    try:
        return tp_plan(model, sequence_parallel)
    except ValueError as exc:
        raise ValueError(f"strategy.tp = {tp}: {exc}") from None
