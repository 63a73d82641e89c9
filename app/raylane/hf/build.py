"""`raylane.hf.pipeline(cfg, train=..., eval=...)`: the Pipeline of a Hugging Face fine-tune, for the
shipped `hf` pipeline and for a user's own `build(cfg)` that hands over `datasets.Dataset`s."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from raylane.hf.config import Config, packed


def flops_per_token(model: Any, seq_len: int) -> float:
    """Forward and backward FLOPs per token, PaLM's count: 6N + 12·L·H·Q·T, N the parameters
    (a tied embedding counted once, as the output head; an untied input embedding, a lookup,
    not at all), from the model's config and its parameters (meta tensors have a numel)."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())  # deduplicated: a tied weight counts once
    embedding = model.get_input_embeddings()
    if embedding is not None and not getattr(c, "tie_word_embeddings", False):
        n -= embedding.weight.numel()
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return float(6 * n + 12 * c.num_hidden_layers * heads * head_dim * seq_len)


def pipeline(cfg: Config, train: Any = None, eval: Any = None):
    """The Pipeline for `cfg` (a `raylane.hf.Config`): the model of `model.name_or_path` built on
    the meta device and filled from its files once it is parallelized (rank 0 reads them), and the
    data: `train` and `eval` when given (a `datasets.Dataset`, or `{name: Dataset}` for eval),
    tokenized here, else the files of `data.train` and `data.eval`, streamed."""
    from raylane.hf import data
    from raylane.hf.experts import ep_plan
    from raylane.hf.tensor_parallel import tp_plan
    from raylane.hf.weights import empty_model, load_pretrained
    from raylane.loop.checkpoint.frozen import set_tokenizer, tokenizer_fingerprint
    from raylane.loop.protocols.pipeline import Pipeline

    m = cfg.model
    causal = m.task == "causal-lm"
    tok = data.tokenizer(data.tokenizer_path(cfg))
    overrides = {} if causal else {"num_labels": m.num_labels, "pad_token_id": data.pad_id(tok)}
    model = empty_model(m.name_or_path, m.task, **overrides)
    if cfg.lora is not None:  # on the meta device: load_pretrained fills the base and starts the adapter
        from raylane.hf.lora import apply_lora

        model = apply_lora(model, cfg.lora, base=str(m.name_or_path))
    train_set, eval_set = _data_sets(cfg, train, eval)  # a dataset's columns resolve data.style auto
    if causal and (packed(cfg.data) or cfg.data.document_mask):
        from raylane.hf.packing import prepare_model

        prepare_model(model)  # its documents kept apart by the mask its attention builds from position ids
    # Its checkpoints record the tokenizer: a resume with one retrained in place is refused.
    where = data.tokenizer_path(cfg)
    key = "model.tokenizer_path" if m.tokenizer_path else "model.name_or_path"
    set_tokenizer(model, {"path": str(where), "fingerprint": tokenizer_fingerprint(where), "key": key})
    example = {"input_ids": _zeros(2, m.seq_len)}
    extra: dict[str, Any]  # the fields of one task or the other, each of its own type
    if causal:
        from raylane.hf.packing import real_tokens
        from raylane.hf.pipeline_parallel import causal_lm_stages

        extra = {
            "pp_stages": causal_lm_stages(),  # strategy.pp: its decoder layers split, names kept
            "eval_count": _predicted_tokens,
            "tokens_per_sample": m.seq_len,
            "real_tokens": functools.partial(real_tokens, pad_id=data.pad_id(tok)),  # packed or padded rows
            "flops_per_token": flops_per_token(model, m.seq_len),
        }
    else:
        example["attention_mask"] = _zeros(2, m.seq_len) + 1
        extra = {"collate_fn": data.collate, "eval_sums": _classification_sums}
    return Pipeline(
        model=model,
        train_set=train_set,
        eval_set=eval_set,
        example_input=example,
        init_weights=functools.partial(load_pretrained, path=m.name_or_path),
        tp_plan=tp_plan,  # the model's own (transformers'), on raylane's mesh: strategy.tp
        ep_plan=ep_plan,  # its experts modules (transformers' own plan): strategy.ep
        **extra,
    )


def _data_sets(cfg: Config, train: Any, eval: Any) -> tuple[Any, Any]:
    """(the training set, the held-out set or sets): the datasets handed in, tokenized here, else
    the files of `data.train` and `data.eval`, streamed."""
    from raylane.config import ConfigError, shapes_only
    from raylane.hf import data, mixture

    if cfg.data.mix is not None:
        if train is not None and not isinstance(train, Mapping):
            raise ConfigError(
                "data.mix with a dataset handed to raylane.hf.pipeline(cfg, train=...): hand a mixture's datasets "
                "by source name, train={name: dataset}, each for a data.mix source of that name without train"
            )
        return data.from_mix(cfg, mixture.handed_datasets(cfg.data.mix, train or {})), _eval_sets(cfg, eval)
    if isinstance(train, Mapping):  # a DatasetDict of splits is one too
        raise ConfigError(
            f"raylane.hf.pipeline(cfg, train={{{', '.join(f'{k!r}: ...' for k in train)}}}): datasets by name are the "
            "sources of data.mix, which is not set; hand one dataset (train=dataset), or set data.mix"
        )
    if train is None and cfg.data.train is None and shapes_only():
        raise ConfigError(
            "data.train = None: the rehearsal reads one micro-batch of it (train.batch_size packed rows of "
            "model.seq_len tokens) to measure activations; give data.train: a local text file that long will do "
            "(data.format: text)"
        )
    if train is None and cfg.data.train is None:
        raise ConfigError(
            "data.train = None: give data.train (files), or hand a dataset to raylane.hf.pipeline(cfg, train=...)"
        )
    train_set = (
        data.from_dataset(cfg, train, "train")
        if train is not None
        else data.file_source(cfg, cfg.data.train, "data.train")
    )
    return train_set, _eval_sets(cfg, eval)


def _eval_sets(cfg: Config, eval: Any) -> Any:
    """The held-out set or sets: the datasets handed in, else the files of data.eval, streamed."""
    from raylane.hf import data

    if isinstance(eval, dict):
        return {name: data.from_dataset(cfg, ds, name) for name, ds in eval.items()}
    if eval is not None:
        return data.from_dataset(cfg, eval, "eval")
    if cfg.data.eval is not None:
        return data.file_source(cfg, cfg.data.eval, "data.eval")
    return None


def _zeros(*shape: int):
    import torch

    return torch.zeros(shape, dtype=torch.long)


def _predicted_tokens(batch: dict[str, Any]) -> Any:
    """The tokens a causal LM's loss averages over: every label but each row's first (shifted
    out) and the masked ones (-100)."""
    return (batch["labels"][:, 1:] != -100).sum()


def _classification_sums(output: Any, batch: dict[str, Any]) -> dict[str, Any]:
    labels = batch["labels"]
    return {"loss": output.loss * len(labels), "accuracy": (output.logits.argmax(-1) == labels).sum().float()}
