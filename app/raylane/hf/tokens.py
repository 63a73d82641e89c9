"""The tokenizer of a Hugging Face fine-tune: loaded once per process, and the id it pads with."""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def tokenizer(path: str):
    """The tokenizer saved in `path`, loaded once per process (each Ray Data task reuses it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenizer_path(cfg: Any) -> str:
    """`model.tokenizer_path`, else the model's own folder."""
    return cfg.model.tokenizer_path or cfg.model.name_or_path


def pad_id(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
