"""Text to batches for Hugging Face models, the same for files and for a `datasets.Dataset`.

- causal-lm: each document is tokenized and ended with the tokenizer's EOS token; the documents
  of a chunk of rows are concatenated and cut into sequences of `seq_len` tokens (the tail shorter
  than a sequence is dropped), with `labels = input_ids` (the model shifts them). Attention and
  the loss cross document boundaries, as in transformers' own run_clm example: the EOS token
  tells the model where a document ends, and no token is padding, so none is masked (-100).
- sequence-classification: each text is truncated to `seq_len` tokens; a batch is padded on the
  right to its longest text, with an attention mask, and its `labels` are the class ids.

Rows become numpy arrays in `transform` (Ray Data's CPU tasks on Ray, the reader thread under
torchrun, or once for an in-memory dataset), and tensors in `to_tensors` (per batch, on the rank).
A row whose text is missing, null or not a string, or whose label is not a class id, is a
DataError naming its row and column before anything is tokenized (`data.skip_bad_rows` drops
such rows instead: raylane.loop.data.baddata.skipping)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from raylane.errors import SKIP_HINT, DataError, is_missing
from raylane.hf.config import Config
from raylane.hf.tokens import pad_id, tokenizer, tokenizer_path  # noqa: F401 - read as raylane.hf.data's too


def _kind(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "a boolean"
    if isinstance(value, (int, float, np.number)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple, np.ndarray)):
        return "a list"
    return f"a {type(value).__name__}"


def bad_texts(texts: list[Any]) -> list[int]:
    """Rows whose text is missing, null or not a string (a number would train as its digits)."""
    return [row for row, text in enumerate(texts) if not isinstance(text, str)]


def text_error(texts: list[Any], bad: list[int], column: str) -> DataError:
    value = texts[bad[0]]
    why = "each row needs its text" if is_missing(value) else f"expected a string, not {_kind(value)}"
    return DataError("data.text_column", column=column, row=bad[0], rows=bad, value=value, why=why + SKIP_HINT)


def bad_labels(labels: Any, num_labels: int) -> tuple[np.ndarray, list[int]]:
    """(the labels as class ids, the rows whose label is not one: missing, not a whole number, or
    outside 0..num_labels-1). A null among a file's labels makes the column float: 1.0 is class 1."""
    values = np.asarray(labels)
    if values.dtype.kind in "iu":
        ok = (values >= 0) & (values < num_labels)
    elif values.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            ok = np.isfinite(values) & (values == np.floor(values)) & (values >= 0) & (values < num_labels)
    else:  # objects (None among numbers), strings, lists: one by one
        ok = np.array([_class_id(v, num_labels) for v in values.tolist()], dtype=bool).reshape(len(values))
    ids = np.where(ok, values, 0).astype(np.int64) if len(values) else np.zeros(0, dtype=np.int64)
    return ids, np.flatnonzero(~ok).tolist()


def _class_id(value: Any, num_labels: int) -> bool:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return bool(math.isfinite(value) and value == int(value) and 0 <= value < num_labels)


def pack(texts: Any, path: str, seq_len: int, column: str = "text") -> dict[str, np.ndarray]:
    """causal-lm: the texts' tokens, each document ended by EOS, in rows of seq_len."""
    texts = list(texts)
    bad = bad_texts(texts)
    if bad:
        raise text_error(texts, bad, column)
    if not texts:  # every row of a chunk skipped
        return {"input_ids": np.zeros((0, seq_len), dtype=np.int64)}
    tok = tokenizer(path)
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    end = [] if tok.eos_token_id is None else [tok.eos_token_id]
    flat = np.fromiter((i for doc in ids for i in (*doc, *end)), dtype=np.int64)
    n = len(flat) // seq_len
    return {"input_ids": flat[: n * seq_len].reshape(n, seq_len)}


def masked_text(texts: Any, path: str, seq_len: int, column: str = "text") -> dict[str, np.ndarray]:
    """causal-lm with data.document_mask: `pack`'s rows, each document's positions and loss its
    own in the rows it is cut into (raylane.hf.packing.documents_in_rows)."""
    from raylane.hf.packing import documents_in_rows

    texts = list(texts)
    bad = bad_texts(texts)
    if bad:
        raise text_error(texts, bad, column)
    if not texts:
        empty: np.ndarray = np.zeros((0, seq_len), dtype=np.int64)
        return {"input_ids": empty, "labels": empty, "position_ids": empty}
    tok = tokenizer(path)
    end = [] if tok.eos_token_id is None else [tok.eos_token_id]
    return documents_in_rows([[*doc, *end] for doc in tok(texts, add_special_tokens=False)["input_ids"]], seq_len)


def encode(
    texts: Any,
    labels: Any,
    path: str,
    seq_len: int,
    num_labels: int,
    label_column: str = "label",
    text_column: str = "text",
) -> dict[str, np.ndarray]:
    """sequence-classification: each text's tokens (truncated, right-padded to seq_len), its
    length and its class id. Bad texts and labels are looked for first: the error names the
    first bad row, and lists every one (`rows`) for skipping."""
    texts = list(texts)
    classes, bad_ids = bad_labels(labels, num_labels)
    bad_text = bad_texts(texts)
    bad = sorted({*bad_text, *bad_ids})
    if bad:
        if bad_text and bad_text[0] == bad[0]:
            raise text_error(texts, bad, text_column)
        value = np.asarray(labels)[bad[0]]
        missing = is_missing(value)
        raise DataError(
            "data.label_column" if missing else f"model.num_labels = {num_labels}",
            column=label_column,
            row=bad[0],
            rows=bad,
            value=value,
            why=("each row needs its label" if missing else f"class ids are whole numbers 0..{num_labels - 1}")
            + SKIP_HINT,
        )
    out: np.ndarray = np.full((len(texts), seq_len), 0, dtype=np.int64)
    lengths = np.zeros(len(texts), dtype=np.int64)
    if texts:  # every row of a chunk may have been skipped
        tok = tokenizer(path)
        out[:] = pad_id(tok)
        for row, doc in enumerate(tok(texts, truncation=True, max_length=seq_len)["input_ids"]):
            out[row, : len(doc)] = doc
            lengths[row] = len(doc)
    return {"input_ids": out, "length": lengths, "labels": classes}


def causal_tensors(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """A causal LM's batch: its labels are its ids, unless the rows carry their own (the answers
    only, a document's first token left out), with each document's position ids where packed."""
    import torch

    from raylane.loop.protocols.batches import TALLY

    ids = torch.as_tensor(batch["input_ids"], dtype=torch.long)
    out = {"input_ids": ids, "labels": torch.as_tensor(batch["labels"], dtype=torch.long) if "labels" in batch else ids}
    if "position_ids" in batch:
        out["position_ids"] = torch.as_tensor(batch["position_ids"], dtype=torch.long)
    out |= {k: torch.as_tensor(v) for k, v in batch.items() if k.startswith(TALLY)}  # the loop's
    return out


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


def transform_for(cfg: Config, kind: str = "text"):
    """The FileSource transform of the config's task (rows -> numpy arrays); `kind`: a causal
    LM's data.style, resolved (raylane.hf.rows)."""
    from raylane.hf import rows

    m, d, path = cfg.model, cfg.data, tokenizer_path(cfg)
    text = "text" if d.format == "text" else d.text_column
    if m.task == "causal-lm":
        own = rows.transform(cfg, kind, str(path))
        if own is not None:
            return own
        if d.document_mask:
            return lambda batch: masked_text(batch[text], path, m.seq_len, text)
        return lambda batch: pack(batch[text], path, m.seq_len, text)
    return lambda batch: encode(batch[text], batch[d.label_column], path, m.seq_len, m.num_labels, d.label_column, text)


def file_source(cfg: Config, paths: Any, key: str):
    from raylane.hf import rows
    from raylane.loop.data.streaming import FileSource

    d, causal = cfg.data, cfg.model.task == "causal-lm"
    text = "text" if d.format == "text" else d.text_column
    kind = rows.style(cfg)
    columns = list(rows.columns(cfg, kind).values()) if causal else [text, d.label_column]
    return FileSource(
        paths=paths,
        format=d.format,
        columns=columns,
        transform=transform_for(cfg, kind),
        keeps_rows=not causal,
        to_tensors=causal_tensors if causal else classification_tensors,
        shuffle_rows=d.shuffle_rows,
        key=key,
        skip_bad_rows=d.skip_bad_rows,
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
            return causal_tensors({k: v[i] for k, v in self.arrays.items()})
        return {k: v[i] for k, v in self.arrays.items()}


def from_dataset(cfg: Config, dataset: Any, name: str) -> Rows:
    """A `datasets.Dataset` (or any table whose columns read as `dataset[column]`), tokenized at once."""
    from raylane.config import ConfigError
    from raylane.hf import rows

    d, causal = cfg.data, cfg.model.task == "causal-lm"
    columns = list(getattr(dataset, "column_names", None) or [])
    text_cfg = cfg.model_copy(update={"data": d.model_copy(update={"format": "json"})})
    try:
        kind = rows.style(text_cfg, columns) if causal and columns else rows.style(text_cfg)
    except ValueError as exc:
        raise ConfigError(f"{exc} (the {name} dataset)") from None
    if causal and d.style == "auto":  # resolved once, by the training data, as files resolve it: packed by default
        d.style = text_cfg.data.style = kind  # type: ignore[assignment]  # one of the styles
    fields = rows.columns(text_cfg, kind) if causal else {"text": d.text_column, "label": d.label_column}
    keys = {"text": "data.text_column", "label": "data.label_column", "messages": "data.messages_column"}
    keys |= {"prompt": "data.prompt_column", "completion": "data.completion_column"}
    for field, column in fields.items():
        if columns and column not in columns:
            raise ConfigError(
                f"{keys[field]} = {column!r}: no such column in the {name} dataset (it has: {', '.join(columns)})"
            )
    from raylane.hf.mixture import objects

    batch = {column: objects(dataset[column]) for field, column in fields.items() if field != "label"}
    if not causal:
        batch[d.label_column] = np.asarray(list(dataset[d.label_column]))
    return Rows(_transformed(transform_for(text_cfg, kind), batch, name, d.skip_bad_rows), causal)


def from_mix(cfg: Config, datasets: list[Any] | None = None) -> Rows:
    """data.mix: an epoch's examples drawn from the sources by weight (raylane.hf.mixture),
    encoded and packed at once; what each source gave is recorded for the summary. A bad row is
    named by its source and its row in the source's files (counted together, in file order) or
    dataset. `datasets`: each source's dataset, None for a source of files (mixture.handed_datasets)."""
    from raylane.hf import mixture, rows
    from raylane.loop.data import baddata

    kind = rows.style(cfg, mixture.dataset_columns(cfg, datasets))  # no files resolved data.style auto
    cfg.data.style = kind  # type: ignore[assignment]  # resolved: packed by default for the conversational styles
    columns = list(rows.columns(cfg, kind).values())
    batch, which, where, taken = mixture.mixed_rows(cfg, columns, datasets)
    mix = cfg.data.mix or []
    names = np.array([mixture.tally_name(mix, i) for i in range(len(mix))], dtype=object)
    batch[rows.GROUP] = names[which]  # each row's source: its share per window (train/source_share/<name>)

    def place(row: int) -> str:  # a row of the draw, named in its source
        return f"{mixture.source_key(mix, int(which[row]))} row {where[row] + 1}"

    out = _transformed(transform_for(cfg, kind), batch, "data.mix", cfg.data.skip_bad_rows, place)
    drawn = {f"from {mixture.name_of(mix, i)}": n for i, n in enumerate(taken)}
    tally = baddata.take_skipped("data.mix dataset") or baddata.Skipped()  # its rows' own: skipped, cut
    tally.rows = int(sum(taken))
    baddata.record_skipped("data.mix", tally.add(baddata.Skipped(), drawn), True)
    return Rows(out, causal=True)


def _transformed(
    transform: Any, batch: dict[str, np.ndarray], name: str, skip: bool | int, place: Any = None
) -> dict[str, np.ndarray]:
    """A dataset's rows transformed at once; a bad row named by its place (`place(row)`; by
    default its place in the dataset, from 1), or skipped; what was skipped, and what the
    transform counted (examples cut to a sequence), recorded as the `<name> dataset`'s."""
    from raylane.loop.data import baddata
    from raylane.loop.data.streaming import split_counts

    place = place or (lambda row: f"the {name} dataset row {row + 1}")
    try:
        out, dropped, first = baddata.skipping(transform, batch) if skip else (transform(batch), 0, None)
    except DataError as exc:
        if exc.place is None and exc.row is not None:
            exc.place = place(exc.row)
        raise
    out, counts = split_counts(out)
    if first is not None:
        first.place = place(first.row or 0)
    if skip or counts:
        rows = len(next(iter(batch.values())))
        line = None if first is None else baddata.skipped_line(first)
        tally = baddata.Skipped(rows=rows, skipped=dropped, first=line, counts=counts)
        baddata.record_skipped(f"{name} dataset", tally, skip, "data.skip_bad_rows")
    return out
