"""Text to batches for Hugging Face models, the same for files and for a `datasets.Dataset`.

- causal-lm: each document is tokenized and ended with the tokenizer's EOS token; the documents
  of a chunk of rows are concatenated and cut into sequences of `seq_len` tokens (the tail shorter
  than a sequence is dropped), with `labels = input_ids` (the model shifts them). Attention and
  the loss cross document boundaries, as in transformers' own run_clm example: the EOS token
  tells the model where a document ends, and no token is padding, so none is masked (-100).
- sequence-classification: each text is truncated to `seq_len` tokens; a batch is padded on the
  right to its longest text, with an attention mask, and its `labels` are the class ids.

Rows become numpy arrays in `transform` (Ray Data's CPU tasks on Ray, the reader thread under
torchrun, or once for an in-memory dataset), and tensors in `to_tensors` (per batch, on the rank)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from raylane.hf.config import Config


@functools.cache
def tokenizer(path: str):
    """The tokenizer saved in `path`, loaded once per process (each Ray Data task reuses it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenizer_path(cfg: Config) -> str:
    return cfg.model.tokenizer_path or cfg.model.name_or_path


def pad_id(tok: Any) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def pack(texts: Any, path: str, seq_len: int) -> dict[str, np.ndarray]:
    """causal-lm: the texts' tokens, each document ended by EOS, in rows of seq_len."""
    tok = tokenizer(path)
    ids = tok([str(t) for t in texts], add_special_tokens=False)["input_ids"]
    end = [] if tok.eos_token_id is None else [tok.eos_token_id]
    flat = np.fromiter((i for doc in ids for i in (*doc, *end)), dtype=np.int64)
    n = len(flat) // seq_len
    return {"input_ids": flat[: n * seq_len].reshape(n, seq_len)}


def encode(
    texts: Any,
    labels: Any,
    path: str,
    seq_len: int,
    num_labels: int,
    label_key: str = "data.label_column",
    label_column: str = "label",
) -> dict[str, np.ndarray]:
    """sequence-classification: each text's tokens (truncated, right-padded to seq_len), its
    length and its class id."""
    from raylane.loop.baddata import DataError

    tok = tokenizer(path)
    ids = tok([str(t) for t in texts], truncation=True, max_length=seq_len)["input_ids"]
    out = np.full((len(ids), seq_len), pad_id(tok), dtype=np.int64)
    lengths = np.zeros(len(ids), dtype=np.int64)
    for row, doc in enumerate(ids):
        out[row, : len(doc)] = doc
        lengths[row] = len(doc)
    classes = np.asarray(labels)
    for row, value in enumerate(classes):
        if not (isinstance(value, (int, np.integer)) and 0 <= value < num_labels):
            raise DataError(
                f"model.num_labels = {num_labels}",
                column=label_column,
                row=row,
                value=value,
                why=f"class ids are whole numbers 0..{num_labels - 1}",
            )
    return {"input_ids": out, "length": lengths, "labels": classes.astype(np.int64)}


def causal_tensors(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    import torch

    ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def classification_tensors(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Padded to the batch's longest text, with its attention mask."""
    import torch

    lengths = torch.as_tensor(batch["length"], dtype=torch.long)
    longest = max(int(lengths.max()), 1) if len(lengths) else 1
    ids = torch.as_tensor(batch["input_ids"][:, :longest], dtype=torch.long)
    mask = (torch.arange(longest)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.as_tensor(batch["labels"], dtype=torch.long)}


def collate(items: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """A map-style dataset's rows (numpy) to a classification batch: padding and attention mask."""
    return classification_tensors({k: np.stack([item[k] for item in items]) for k in items[0]})


def transform_for(cfg: Config):
    """The FileSource transform of the config's task (rows -> numpy arrays)."""
    m, d, path = cfg.model, cfg.data, tokenizer_path(cfg)
    text = "text" if d.format == "text" else d.text_column
    if m.task == "causal-lm":
        return lambda batch: pack(batch[text], path, m.seq_len)
    return lambda batch: encode(
        batch[text], batch[d.label_column], path, m.seq_len, m.num_labels, label_column=d.label_column
    )


def file_source(cfg: Config, paths: Any, key: str):
    from raylane.loop.streaming import FileSource

    d, causal = cfg.data, cfg.model.task == "causal-lm"
    text = "text" if d.format == "text" else d.text_column
    columns = [text] if causal else [text, d.label_column]
    return FileSource(
        paths=paths,
        format=d.format,
        columns=columns,
        transform=transform_for(cfg),
        keeps_rows=not causal,
        to_tensors=causal_tensors if causal else classification_tensors,
        shuffle_rows=d.shuffle_rows,
        key=key,
    )


class Rows:
    """A map-style dataset over arrays of rows: a causal-LM's sequences (items are tensors,
    stacked by default collation) or a classifier's encoded texts (numpy rows, for `collate`)."""

    def __init__(self, arrays: dict[str, np.ndarray], causal: bool) -> None:
        self.arrays, self.causal = arrays, causal

    def __len__(self) -> int:
        return len(self.arrays["input_ids"])

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.causal:
            return causal_tensors({"input_ids": self.arrays["input_ids"][i]})
        return {k: v[i] for k, v in self.arrays.items()}


def from_dataset(cfg: Config, dataset: Any, name: str) -> Rows:
    """A `datasets.Dataset` (or any table whose columns read as `dataset[column]`), tokenized at once."""
    from raylane.config import ConfigError

    d, causal = cfg.data, cfg.model.task == "causal-lm"
    columns = list(getattr(dataset, "column_names", None) or [])
    wanted = [("data.text_column", d.text_column)] + ([] if causal else [("data.label_column", d.label_column)])
    for key, column in wanted:
        if columns and column not in columns:
            raise ConfigError(
                f"{key} = {column!r}: no such column in the {name} dataset (it has: {', '.join(columns)})"
            )
    batch = {d.text_column: dataset[d.text_column]}
    if not causal:
        batch[d.label_column] = dataset[d.label_column]
    text_cfg = cfg.model_copy(update={"data": d.model_copy(update={"format": "json"})})
    return Rows(transform_for(text_cfg)(batch), causal)
