"""A Hugging Face model's export that the ecosystem reads: `raylane export CKPT --format hf
--out DIR` writes a `save_pretrained` folder (config, safetensors shards with an index when
large, the tokenizer's files) that `AutoModelFor...from_pretrained(DIR)` loads. A LoRA run is
merged into its base (peft's `merge_and_unload`), or with `adapter_only` written as a peft
adapter that `PeftModel.from_pretrained(base, DIR)` loads. Ties (input and output embeddings)
are transformers' own save_pretrained's to handle."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("raylane")


def is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def is_transformers(model: Any) -> bool:
    """A transformers PreTrainedModel, or a peft model around one."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    if isinstance(model, PreTrainedModel):
        return True
    return is_peft(model) and isinstance(model.get_base_model(), PreTrainedModel)


def export_hf(
    model: Any, tokenizer: Any, out_dir: str | Path, adapter_only: bool = False, max_shard_size: str | int = "5GB"
) -> Path:
    """Write `model` (a PreTrainedModel, or a peft model: merged into its base unless
    `adapter_only`) and `tokenizer` (or None) into `out_dir` with `save_pretrained`. A peft model
    is merged in place: the object is the export's afterwards, not the run's."""
    out = Path(out_dir)
    if adapter_only and not is_peft(model):
        raise ValueError("--adapter-only: the checkpoint's model has no adapter (it was fine-tuned in full)")
    if not is_transformers(model):
        raise ValueError(
            f"--format hf: the checkpoint's model is a {type(model).__name__}, not a transformers PreTrainedModel"
        )
    out.mkdir(parents=True, exist_ok=True)
    if adapter_only:
        model.save_pretrained(str(out))  # adapter_config.json and adapter_model.safetensors
    else:
        if is_peft(model):
            model = model.merge_and_unload()
        # Packed rows turned the cache off for training (raylane.hf.packing.prepare_model); the
        # export is for generation, which wants it, as transformers' configs have it by default.
        model.config.use_cache = True
        model.save_pretrained(str(out), max_shard_size=max_shard_size)
    if tokenizer is not None:
        with_pad(tokenizer, model).save_pretrained(str(out))
    return out


def tokenizer_place(cfg: Any) -> str | None:
    """Where the run's tokenizer is: `model.tokenizer_path`, else `model.name_or_path` (the hf
    pipeline's keys); None when the config names neither."""
    model_cfg = getattr(cfg, "model", None)
    where = getattr(model_cfg, "tokenizer_path", None) or getattr(model_cfg, "name_or_path", None)
    return str(where) if where else None


def tokenizer_for(cfg: Any) -> Any:
    """The run's tokenizer (tokenizer_place), or None when there is none: its callers say in one
    line what that means for them."""
    where = tokenizer_place(cfg)
    if where is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as exc:
        log.debug("no tokenizer at %s: %s", where, exc)
        return None


def with_pad(tokenizer: Any, model: Any) -> Any:
    """`tokenizer` with the pad token the run used: a classifier's batches were padded with the
    model's pad_token_id (hf.data.pad_id: the tokenizer's pad token, else its EOS), which a
    tokenizer saved without one (GPT-2's) does not carry, and `tokenizer(texts, padding=True)`
    then refuses."""
    base = model.get_base_model() if is_peft(model) else model
    pad = getattr(getattr(base, "config", None), "pad_token_id", None)
    if tokenizer is not None and tokenizer.pad_token_id is None and isinstance(pad, int):
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(pad)
    return tokenizer


def export_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path, adapter_only: bool = False) -> Path:
    """`raylane export CKPT --format hf --out DIR`: the pipeline rebuilt from the checkpoint's
    config (its base weights loaded as the run loaded them), the checkpoint loaded into it, and
    the result written by export_hf."""
    from transformers.utils import logging as hf_logging

    from raylane.export import consolidated

    # Its progress bars (loading, writing shards) are library chatter on raylane's terminal.
    hf_logging.disable_progress_bar()
    pipe, _, train_state = consolidated(checkpoint_dir)
    from raylane.config import validate
    from raylane.export import one_process

    cfg = validate(one_process(train_state["config"]))
    tokenizer = tokenizer_for(cfg)
    if tokenizer is None:
        log.warning("export: no tokenizer at %s; the export has none", tokenizer_place(cfg) or "the config's model")
    return export_hf(pipe.model, tokenizer, out_dir, adapter_only=adapter_only)


# What a logged text-generation model generates per call by default (the pipeline's own default,
# the model's max_length, can exceed a small model's positions).
GENERATE_TOKENS = 32


# model.task -> the transformers pipeline MLflow's transformers flavour serves the model with.
PIPELINE_TASKS = {"causal-lm": "text-generation", "sequence-classification": "text-classification"}


def _task(model: Any) -> str | None:
    from raylane.hf.tasks import task_of

    return PIPELINE_TASKS.get(task_of(model) or "")


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """MLflow's transformers flavour looks the model's name up on the Hugging Face Hub for its
    card and license (retrying for about a minute where the hub cannot be reached). A fine-tuned
    model is not the hub's: offline mode, which huggingface_hub reads from its constants (the
    environment variable only counts at its import)."""
    import huggingface_hub.constants as hub

    was, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = was


def log_mlflow_model(
    model: Any, tokenizer: Any, example: Any, *, name: str = "model", registered_model_name: str | None = None
) -> Any:
    """Log `model` (a LoRA run merged into its base) with its tokenizer into the active MLflow
    run with the transformers flavour, which `mlflow.pyfunc.load_model(uri).predict([text])`
    serves: text-generation for a causal LM, text-classification for a classifier. Returns the
    ModelInfo, or None when the model has no such task or no tokenizer, said in one line (the
    caller logs it with the PyTorch flavour). `example`: the model's inputs for two rows
    (input_ids), decoded into the input example."""
    base = model.get_base_model() if is_peft(model) else model
    task = _task(base)
    if task is None or tokenizer is None:
        why = "no tokenizer" if tokenizer is None else "neither a causal LM nor a sequence classifier"
        log.warning(
            "MLflow: the model (%s) is logged with the PyTorch flavour, which takes token ids, not text: %s",
            type(base).__name__,
            why,
        )
        return None
    tokenizer = with_pad(tokenizer, model)
    import mlflow.transformers
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # saving and loading shards: library chatter on raylane's terminal

    if is_peft(model):
        model = model.merge_and_unload()
    ids = example.get("input_ids") if isinstance(example, dict) else None
    # A few tokens of each row: a whole row and the tokens generated after it can exceed the
    # model's positions, and MLflow's check of the example would fail on it.
    texts = tokenizer.batch_decode(ids[:2, :8], skip_special_tokens=True) if ids is not None else ["Hello"]
    config = {"max_new_tokens": GENERATE_TOKENS} if task == "text-generation" else None
    with _hub_offline():
        return mlflow.transformers.log_model(
            {"model": model, "tokenizer": tokenizer},
            name=name,
            task=task,
            input_example=texts,
            model_config=config,
            registered_model_name=registered_model_name,
            # Explicit: inferring requirements imports the model in a subprocess (seconds).
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", f"transformers=={transformers.__version__}"],
        )
