"""LoRA through peft: the `lora:` config section and `apply_lora(model, cfg.lora)`.

Only the adapter's parameters train (peft freezes the rest), so raylane's optimizer holds state
for them alone (raylane.loop.optim leaves frozen parameters out), and a checkpoint of the run
holds them, their optimizer state and the loop's state, not the base weights
(raylane.loop.checkpoint.frozen): `apply_lora` marks the model with the base it was built on (its path and
a fingerprint), which the checkpoint's manifest records, and a resume on another base is refused
naming both."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from raylane.config import ConfigError, Section
from raylane.loop.checkpoint.frozen import frozen_base

# Names of a model's attention projections, when no module class says "Attention" (the
# fallback after the projections of its attention modules, then peft's own defaults).
_ATTENTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "query", "key", "value", "qkv_proj", "c_attn", "Wqkv")


class LoraSection(Section):
    """`lora:` in a pipeline's Config (`lora: LoraSection | None = None`: no LoRA by default)."""

    r: int = Field(8, ge=1, description="The adapter's rank.")
    alpha: float = Field(16.0, gt=0, description="The update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] | None = Field(
        None,
        description="Modules to adapt, by the last part of their dotted name (as peft matches them), or by a "
        "dotted end of it (`attn.c_proj`: only the c_proj under an attn). null: the model's attention "
        "projections (the Linear layers of its attention modules: q/k/v/o_proj for LLaMA; c_attn and "
        "attn.c_proj for GPT-2, whose MLP has a c_proj too).",
    )


def attention_projections(model: Any) -> list[str]:
    """The Linear (or GPT-2's Conv1D) layers directly under the model's attention modules (a
    class whose name has "Attention"), as peft's target_modules: each by its last name where that
    name is an attention projection's only, else by the shortest dotted end of its name that is
    (GPT-2's MLP has a c_proj too: "attn.c_proj"). Else those of `_ATTENTION_NAMES` the model has,
    else peft's defaults for its model type. Empty when none is found."""
    import torch

    def projection(module: Any) -> bool:
        return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"

    names = [name for name, _ in model.named_modules()]
    found = [
        f"{name}.{child}" if name else child
        for name, module in model.named_modules()
        if "Attention" in type(module).__name__
        for child, inner in module.named_children()
        if projection(inner)
    ]
    if found:
        return _shortest_ends(found, names)
    last = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if projection(m)}
    if own := [n for n in _ATTENTION_NAMES if n in last]:
        return own
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return list(defaults.get(model_type) or ())


def _matches(target: str, name: str) -> bool:
    """peft's match of a target_modules entry against a module's name."""
    return name == target or name.endswith("." + target)


def _shortest_ends(targets: list[str], names: list[str]) -> list[str]:
    """For each of `targets` (modules' full names), the shortest dotted end of its name that
    matches no module of `names` but targets; in first-found order, each once."""
    wanted = set(targets)
    only: dict[str, bool] = {}  # a dotted end -> whether it matches targets alone
    out: dict[str, None] = {}
    for full in targets:
        parts = full.split(".")
        for start in range(len(parts) - 1, -1, -1):
            end = ".".join(parts[start:])
            if end not in only:
                only[end] = all(n in wanted for n in names if _matches(end, n))
            if only[end]:
                out[end] = None
                break
    return list(out)


def _targets(model: Any, lora: LoraSection) -> list[str]:
    if lora.target_modules is None:
        targets = attention_projections(model)
        if not targets:
            raise ConfigError(
                f"lora.target_modules = None: found no attention projection in {type(model).__name__}; "
                "name the modules to adapt, e.g. lora.target_modules=[q_proj,v_proj]"
            )
        return targets
    names = [name for name, _ in model.named_modules()]
    if missing := [t for t in lora.target_modules if not any(_matches(t, n) for n in names)]:
        ours = sorted(attention_projections(model))
        hint = f" (its attention projections: {', '.join(ours)})" if ours else ""
        raise ConfigError(
            f"lora.target_modules = {lora.target_modules!r}: {type(model).__name__} has no module "
            f"named {missing[0]!r}{hint}"
        )
    if hit := _experts_targeted(model, lora.target_modules):
        raise ConfigError(
            f"lora.target_modules = {lora.target_modules!r}: {hit[0]!r} names the experts module {hit[1]} "
            f"({type(model.get_submodule(hit[1])).__name__}), every expert's weights in 3-D parameters, not Linear "
            "layers: peft adapts those only through its target_parameters, which raylane's lora section does not "
            "take (nor would strategy.ep split such an adapter with its experts); adapt the attention (the default) "
            "or a shared expert's Linear layers"
        )
    return list(lora.target_modules)


def _experts_targeted(model: Any, targets: list[str]) -> tuple[str, str] | None:
    """(a target, the experts module it names) where one of `targets` names a fused experts
    module of the model's own expert plan (raylane.hf.experts); None for a dense model."""
    from raylane.hf.experts import ep_plan
    from raylane.loop.distributed.expert_plan import resolve_ep_plan

    plan = ep_plan(model)
    if not plan:
        return None
    try:
        experts = resolve_ep_plan(model, plan)
    except ValueError:  # a plan this model does not follow is strategy.ep's to refuse, not LoRA's
        return None
    return next(((t, path) for t in targets for path in experts if _matches(t, path)), None)


def apply_lora(
    model: Any, lora: LoraSection, *, base: str | None = None, key: str | None = "model.name_or_path"
) -> Any:
    """`model` (a transformers PreTrainedModel with its base weights, or on the meta device)
    wrapped by peft with a LoRA adapter on `lora.target_modules`; every other parameter frozen.
    `base`: where the base weights come from (default: the model's `name_or_path`, which
    `from_pretrained` sets), recorded with a fingerprint in the run's checkpoints; `key`: the
    config key that names it, so that a relaunch on another base exits 2 before it starts."""
    from peft import LoraConfig, get_peft_model

    base = base if base is not None else str(getattr(model, "name_or_path", "") or "")
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=_targets(model, lora),
        task_type=_task_type(model),
    )
    wrapped = get_peft_model(model, config)
    frozen_base(wrapped, base, key=key)
    return wrapped


def _task_type(model: Any) -> str | None:
    """peft's task type for what the model does (raylane.hf.tasks.task_of: transformers' own
    registry, so GPT2LMHeadModel is a causal LM): its PeftModel subclass then saves and merges
    as the class's own, and a classifier's head stays trainable (peft's modules_to_save)."""
    from raylane.hf.tasks import task_of

    return {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}.get(task_of(model) or "")


def check_lora(name_or_path: str, lora: LoraSection, model_class: str = "AutoModelForCausalLM") -> list[str]:
    """Before a launch: the modules `lora` adapts in the model at `name_or_path` (a
    `save_pretrained` folder), found in a model built on the meta device from its config (no
    weight read, no memory); ConfigError naming lora.target_modules when they name no module.
    `model_class`: the transformers Auto class the pipeline loads the model with."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(name_or_path)
    with torch.device("meta"):
        model = getattr(transformers, model_class).from_config(config)
    return _targets(model, lora)


def init_adapter(model: Any) -> int:
    """The adapter's weights as peft initializes them (lora_A random, lora_B zeros, so that the
    adapted model starts as its base), for a model wrapped by `apply_lora` on the meta device
    and then given memory (`to_empty`), which leaves them garbage: the base's weights come from
    its files, the adapter's from here. Call it before sharding, on every rank alike (raylane
    seeds every rank with train.seed before build), or on rank 0 before its state is broadcast.
    Returns the number of adapted modules."""
    from peft.tuners.lora import LoraLayer

    count = 0
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in module.lora_A:
                module.reset_lora_parameters(adapter, True)
            count += 1
    return count
