"""What a Hugging Face model does, by transformers' own registry of its class: the tasks raylane
fine-tunes (`model.task`). Importing it imports neither torch nor transformers."""

from __future__ import annotations

from typing import Any

TASKS = ("causal-lm", "sequence-classification")


def mapping(task: str) -> dict[str, Any]:
    """transformers' own registry of the models that do `task`: model_type -> class name(s)."""
    from transformers.models.auto import modeling_auto

    if task == "causal-lm":
        return modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES


def class_names(task: str) -> set[str]:
    names = mapping(task).values()
    return {n for v in names for n in ((v,) if isinstance(v, str) else v)}


def task_of(model: Any) -> str | None:
    """The model.task a transformers model does: the task whose Auto class builds its class (or a
    class it derives from), as transformers registers them, so that GPT2LMHeadModel is a causal
    LM whatever its name; else a model that generates (GenerationMixin) and is no encoder-decoder
    is a causal LM (one registered with AutoModelForCausalLM.register). None for any other."""
    mro = {c.__name__ for c in type(model).__mro__}
    for task in TASKS:
        if mro & class_names(task):
            return task
    can_generate = getattr(model, "can_generate", None)
    config = getattr(model, "config", None)
    if callable(can_generate) and can_generate() and not getattr(config, "is_encoder_decoder", False):
        return "causal-lm"
    return None
