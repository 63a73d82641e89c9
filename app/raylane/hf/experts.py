"""Expert parallelism for Hugging Face mixtures of experts: which modules are the model's experts,
from the model's own expert plan. transformers 5 declares one per MoE family on its config class
(`base_model_ep_plan`: `{"layers.*.mlp.experts": "ep_dispatch_experts", "layers.*.mlp.experts.
gate_up_proj": "grouped_gemm", ...}` for qwen2_moe, qwen3_moe, mixtral, deepseek_v3, ...): the keys
marked `ep_dispatch_experts` are its fused experts modules (every expert's weights in one tensor
per projection, the experts leading; forward(hidden, top_k_index, top_k_weights)), the contract
raylane.loop.distributed.expert_plan reads. The other keys say how transformers' own inference path
splits their weights; raylane lays the experts out itself (raylane.loop.distributed.expert_parallel),
on its own mesh, as it does transformers' tensor-parallel plans (raylane.hf.tensor_parallel).

Checked before anything starts from config.json alone (no model built): a dense model, a family
transformers gives no such plan, and a number of experts that `strategy.ep` does not divide."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers' name, in a base_model_ep_plan, for a module whose forward dispatches tokens to experts.
EP_DISPATCH = "ep_dispatch_experts"
# Where a config.json says how many experts each MoE layer has (mixtral's num_local_experts,
# deepseek's n_routed_experts; transformers maps each family's name onto the others).
EXPERT_COUNTS = ("num_experts", "num_local_experts", "moe_num_experts", "n_routed_experts")


def experts_plan(config: Any) -> list[str]:
    """The experts modules' path patterns in a transformers config's own plan, from its base
    model's root: [] for a dense model (no plan, or no experts)."""
    plan = getattr(config, "base_model_ep_plan", None) or {}
    if not _count(config.to_dict())[1]:  # a family's config made dense (num_experts 0)
        return []
    return [pattern for pattern, style in plan.items() if style == EP_DISPATCH]


def ep_plan(model: Any) -> list[str]:
    """The Pipeline.ep_plan of a transformers model (or a peft model around one): its experts
    modules' path patterns, under the names `model` holds them by (the base model's prefix,
    `model.`, and peft's wrapper, `base_model.model.`). [] for a dense model."""
    from raylane.hf.tensor_parallel import pretrained_of

    prefix, pretrained = pretrained_of(model)
    base = getattr(pretrained, "base_model_prefix", "")
    inner = bool(base) and hasattr(pretrained, base)  # a head model holds its base under the prefix
    roots = [part for part in (prefix, base if inner else "") if part]
    return [".".join([*roots, pattern]) for pattern in experts_plan(pretrained.config)]


def check_expert_parallel(folder: str | Path, ep: int) -> None:
    """Before anything starts, from the config.json in `folder` (no model built): a model with
    experts that `ep` divides and transformers' plan naming them. ValueError naming strategy.ep."""
    from transformers import AutoConfig

    path = Path(folder) / "config.json"
    raw = json.loads(path.read_text())
    config = AutoConfig.from_pretrained(str(folder))
    kind = raw.get("model_type", type(config).__name__)
    key, count = _count(raw)
    if not count:
        raise ValueError(
            f"strategy.ep = {ep}: model.name_or_path = {str(folder)!r} is a dense {kind!r} model ({path} gives no "
            f"{', '.join(EXPERT_COUNTS[:-1])} or {EXPERT_COUNTS[-1]}): expert parallelism splits a mixture of "
            "experts' experts; use strategy.ep: 1"
        )
    if not experts_plan(config):
        raise ValueError(
            f"strategy.ep = {ep}: transformers gives a {kind!r} model no expert-parallel plan (its "
            f"{type(config).__name__} has no base_model_ep_plan naming {EP_DISPATCH} modules); use strategy.ep: 1, "
            "or a pipeline of your own with an ep_plan"
        )
    if count % ep:
        raise ValueError(
            f"strategy.ep = {ep}: does not divide the {count} experts of the {kind!r} model ({key} in {path}), "
            "which each of the ep ranks holds an equal share of"
        )


def _count(config: dict[str, Any]) -> tuple[str | None, int]:
    """(the key, the number of experts) a config's dict gives, or its text model's (a
    multimodal model's decoder); (None, 0) for none."""
    for where, values in (("", config), ("text_config.", config.get("text_config") or {})):
        for key in EXPERT_COUNTS:
            value = values.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return f"{where}{key}", value
    return None, 0
