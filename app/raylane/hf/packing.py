"""Examples packed into sequences of `model.seq_len` tokens, so that no compute goes to padding,
without one example seeing another: the documents of a packed row restart their position ids at
0, and a transformers model given `position_ids` and no `attention_mask` masks its attention at
every restart (transformers' `find_packed_sequence_indices`: the model's own mask, whichever
attention it runs: sdpa, eager, flex or flash). The loss never predicts across a boundary either:
a model's labels are shifted by one, so the first token of each document would be the target of
the last token of the one before (torchtitan's PR #4075); its label is -100, as an example's
first token is never a target on its own.

Packing is best-fit decreasing (TRL's `bfd`) within the examples handed over (a buffer): longest
first, each into the fullest sequence it fits, ties to the earliest; the documents of a sequence
keep their order in the buffer. The result depends on the examples alone, not on the rank or the
world size, and is the same for the same buffer every time. An example longer than a sequence is
cut to it (its tail, answer tokens included, is lost: raylane.hf.rows counts it).

Pure numpy: rows in, arrays out, where the data is read (Ray Data's tasks, the reader thread)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

IGNORE = -100  # transformers' label for "no loss here"


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into `lengths`, each summing to at most `capacity` (every length at most
    `capacity`): longest first (ties: the earlier index), each into the bin with the least room
    that holds it (ties: the earlier bin), else a new one. Each bin's indices ascending."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rooms: list[tuple[int, int]] = []  # (room left, bin), sorted: the least room that fits is found by bisection
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"an example of {n} tokens is longer than a sequence of {capacity}")
        at = bisect.bisect_left(rooms, (n, -1))
        if at < len(rooms):
            room, b = rooms.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(rooms, (room - n, b))
    return [sorted(b) for b in bins]


@dataclass
class PackedRows:
    """Packed sequences: `input_ids`, `labels` and `position_ids`, each (rows, seq_len), and each
    row's real (non-padding) tokens."""

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    row_tokens: np.ndarray  # each row's real tokens
    groups: dict[str, np.ndarray] = field(default_factory=dict)  # `pack(groups=)`: each row's examples of each

    @property
    def real_tokens(self) -> int:
        return int(self.row_tokens.sum())

    def arrays(self) -> dict[str, np.ndarray]:
        from raylane.loop.protocols.batches import TALLY

        tallies = {TALLY + name: counts for name, counts in self.groups.items()}
        return {"input_ids": self.input_ids, "labels": self.labels, "position_ids": self.position_ids} | tallies


def pack(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    seq_len: int,
    pad_id: int,
    *,
    packing: bool = True,
    groups: Sequence[str] | None = None,
) -> PackedRows:
    """`examples` ((ids, labels) each, -100 where no loss) into rows of `seq_len`: packed by
    best-fit decreasing, or one a row (`packing=False`, padded: an unpacked run's rows). Padding
    has label -100 and position ids of its own from 0 (a document no real token attends to).
    `groups`: each example's group (a mixture's source), counted per row (PackedRows.groups)."""
    docs = [
        (np.asarray(ids[:seq_len], dtype=np.int64), np.asarray(lab[:seq_len], dtype=np.int64)) for ids, lab in examples
    ]
    lengths = [len(ids) for ids, _ in docs]
    bins = best_fit_decreasing(lengths, seq_len) if packing else [[i] for i in range(len(docs))]
    shape = (len(bins), seq_len)
    input_ids: np.ndarray = np.full(shape, pad_id, dtype=np.int64)
    labels: np.ndarray = np.full(shape, IGNORE, dtype=np.int64)
    positions: np.ndarray = np.zeros(shape, dtype=np.int64)
    row_tokens: np.ndarray = np.zeros(len(bins), dtype=np.int64)
    for row, members in enumerate(bins):
        at = 0
        for i in members:
            ids, lab = docs[i]
            n = len(ids)
            input_ids[row, at : at + n] = ids
            labels[row, at : at + n] = lab
            labels[row, at] = IGNORE  # the previous document's last token does not predict this one
            positions[row, at : at + n] = np.arange(n)
            at += n
        positions[row, at:] = np.arange(seq_len - at)
        row_tokens[row] = at
    counted: dict[str, np.ndarray] = {}
    if groups is not None:
        for name in dict.fromkeys(groups):
            counted[name] = np.array([sum(groups[i] == name for i in b) for b in bins], dtype=np.int64)
    return PackedRows(input_ids, labels, positions, row_tokens, counted)


def real_tokens(batch: dict, pad_id: int):
    """The tokens of a batch of `pack`'s rows that are data (a tensor of one number), or None for
    rows without position ids (plain text joined and cut: no padding). A row's padding is its last
    document when every token of it is `pad_id` with no label: a real example always carries
    some label or some other token (one with neither has nothing to learn and is left out)."""
    import torch

    positions = batch.get("position_ids")
    if positions is None:
        return None
    ids, labels = batch["input_ids"], batch["labels"]
    index = torch.arange(ids.shape[-1]).expand_as(ids)
    last = torch.where(positions == 0, index, 0).amax(dim=-1, keepdim=True)  # each row's last document's start
    tail = index >= last
    padding = (tail & ((ids != pad_id) | (labels != IGNORE))).sum(-1) == 0  # its last document is padding
    return ids.numel() - torch.where(padding, tail.sum(-1), 0).sum()


def documents_in_rows(docs: Sequence[Sequence[int]], seq_len: int) -> dict[str, np.ndarray]:
    """Plain text with `data.document_mask`: the documents concatenated and cut into rows of
    `seq_len` as before (the tail shorter than a row dropped), each document's position ids from
    0 where it starts, or where a row cuts it, and no label on its first token in a row."""
    flat: np.ndarray = np.fromiter((t for d in docs for t in d), dtype=np.int64)
    starts: np.ndarray = np.zeros(len(flat), dtype=bool)
    offsets = np.cumsum([0, *[len(d) for d in docs[:-1]]]) if docs else np.zeros(0, dtype=np.int64)
    starts[offsets[offsets < len(flat)]] = True
    n = len(flat) // seq_len
    flat, starts = flat[: n * seq_len].reshape(n, seq_len), starts[: n * seq_len].reshape(n, seq_len)
    starts[:, 0] = True  # a row starts its first document's positions anew
    # Positions count from each start: the index minus the index of the latest start at or before it.
    index = np.broadcast_to(np.arange(seq_len), (n, seq_len))
    latest = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    labels = np.where(starts, IGNORE, flat)
    return {"input_ids": flat, "labels": labels, "position_ids": index - latest}


def prepare_model(model) -> None:
    """Make `model` (a transformers model, or a peft model around one) take packed rows: its own
    attention mask from the position ids, which transformers builds only without a cache, and a
    forward without `use_cache` makes one (the model's config says True: training needs none).
    ValueError (one line) for a model whose attention builds no such mask."""
    from raylane.hf.tensor_parallel import pretrained_of

    _, pretrained = pretrained_of(model)
    why = _unpackable(type(pretrained))
    if why is not None:
        raise ValueError(f"{why}; set data.packing: false")
    pretrained.config.use_cache = False


def packable(folder: str) -> str | None:
    """Before anything starts: why the causal LM saved in `folder` cannot keep packed documents
    apart, or None when it can (its class read from config.json, no model built)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(folder)
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return f"{type(config).__name__} has no causal LM class in transformers"
    return _unpackable(cls)


def _unpackable(cls: type) -> str | None:
    """Why the transformers model class `cls` cannot: an architecture written before
    transformers' mask functions (they build the mask from position ids), or one without
    position ids (a state-space model: mamba, rwkv)."""
    import inspect
    import sys

    module = sys.modules.get(cls.__module__)
    takes = "position_ids" in inspect.signature(getattr(cls, "forward")).parameters  # noqa: B009 - any class
    masks = module is not None and any(
        hasattr(module, name) for name in ("create_causal_mask", "create_sliding_window_causal_mask")
    )
    if takes and masks:
        return None
    return f"{cls.__name__} cannot keep packed documents apart (its attention builds no mask from position ids)"
