"""A causal LM's training rows from rows of any `data.style` (issue 64): each row encoded as one
example, its labels on the answers (raylane.hf.examples), and the examples of a batch of rows
packed into sequences of `model.seq_len` (raylane.hf.packing), or one a row, padded. Plain text
keeps its own way unless packed (documents joined end to end and cut: raylane.hf.data.pack, with
`data.document_mask` its documents kept apart in the rows it cuts).

A transform here runs where the data is read (Ray Data's tasks, the reader thread, or once over
an in-memory dataset), on numpy batches, and returns `input_ids`, `labels` and `position_ids`,
each (rows, seq_len). A bad row (not a conversation, an unknown role) is a DataError naming
its row and column; `data.skip_bad_rows` drops it as any other bad row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from raylane.errors import DataError
from raylane.hf.config import Config, packed
from raylane.hf.tokens import pad_id, tokenizer
from raylane.loop.data.streaming import COUNT

Batch = dict[str, np.ndarray]
# What a batch's rows counted (raylane.loop.data.streaming.COUNT), as the summary names them.
UNANSWERED = "without an answer (left out)"
CUT = "cut to model.seq_len"
DROPPED = "longer than model.seq_len, dropped (data.drop_cut)"
# A column of each row's group (a mixture's source name, raylane.hf.data.from_mix): its examples
# are counted per packed row and reach the loop as tallies (raylane.loop.protocols.batches.TALLY).
GROUP = "raylane:group"


def style(cfg: Config, names: list[str] | None = None) -> str:
    """The config's style, `auto` resolved against `names` (a dataset's columns), else `text`
    (the files' check resolved it already: raylane.hf.config.check_columns)."""
    d = cfg.data
    if d.style != "auto" or names is None:
        return "text" if d.style == "auto" else d.style
    from raylane.hf.examples import style_of

    return style_of(
        names, d.style, messages=d.messages_column, prompt=d.prompt_column, completion=d.completion_column,
        text=d.text_column, key="data.style",
    )  # fmt: skip


def columns(cfg: Config, kind: str) -> dict[str, str]:
    """The style's fields -> the files' columns."""
    d = cfg.data
    text = "text" if d.format == "text" else d.text_column
    return {
        "text": {"text": text},
        "messages": {"messages": d.messages_column},
        "prompt_completion": {"prompt": d.prompt_column, "completion": d.completion_column},
    }[kind]


def transform(cfg: Config, kind: str, path: str) -> Callable[[Batch], Batch] | None:
    """The transform for a causal LM's rows of style `kind`; None: plain text joined and cut
    (raylane.hf.data.pack, or masked_text with data.document_mask)."""
    d, seq_len = cfg.data, cfg.model.seq_len
    fields = columns(cfg, kind)
    if kind == "text" and not packed(d):
        return None
    loss_on, drop_cut, pack_them = d.loss_on, d.drop_cut, packed(d)

    def to_rows(batch: Batch) -> Batch:
        return encoded_rows(batch, kind, fields, path, seq_len, loss_on=loss_on, packing=pack_them, drop_cut=drop_cut)

    return to_rows


def encoded_rows(
    batch: Batch,
    kind: str,
    fields: dict[str, str],
    path: str,
    seq_len: int,
    *,
    loss_on: str = "answers",
    packing: bool = True,
    drop_cut: bool = False,
) -> Batch:
    """`batch`'s rows encoded (their bad rows first: DataError naming the first, listing every
    one for data.skip_bad_rows), then packed, or one a row. A conversation with no assistant turn
    has nothing to learn and is left out, as is an example longer than a sequence with drop_cut."""
    from raylane.hf.examples import encode
    from raylane.hf.packing import pack

    tok = tokenizer(path)
    n = len(next(iter(batch.values()))) if batch else 0
    examples, bad, first = [], [], None
    group = batch.get(GROUP)
    groups: list[str] | None = None if group is None else []
    unanswered = long = 0
    for i in range(n):
        row = {field: batch[column][i] for field, column in fields.items()}
        try:
            example = encode(_plain(row), kind, tok, loss_on=loss_on, row_index=i, columns=fields)
        except DataError as exc:
            bad.append(i)
            first = first or exc
            continue
        if example is None:
            unanswered += 1
            continue
        long += len(example.ids) > seq_len
        if not (drop_cut and len(example.ids) > seq_len):
            examples.append((example.ids, example.labels))
            if groups is not None:
                groups.append(str(group[i]))  # type: ignore[index]  # set with groups
    if first is not None:
        first.rows = bad
        raise first
    counted = {UNANSWERED: unanswered, DROPPED if drop_cut else CUT: long}
    return pack(examples, seq_len, pad_id(tok), packing=packing, groups=groups).arrays() | {
        COUNT + what: np.array([k]) for what, k in counted.items() if k
    }


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """Arrow's values as Python's: a list column read as numpy arrays of dicts becomes lists."""
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()}
