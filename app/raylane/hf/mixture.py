"""`data.mix`: several sources drawn by weight at the example level (issue 64). The draw is a
function of the sources' sizes, the weights and the seed alone, so every rank, every world size
and every resume draws the same examples in the same order; a resume continues it where the
checkpoint's position says (the draw's state is (seed, position), both in the checkpoint).

The draw interleaves by deficit: each next example comes from the source furthest below its
share so far (ties: the earlier source), so the realised shares are within one example of the
weights at every point of the draw, not only on average. Within a source, its rows come in an
order shuffled from the seed, a new one each time the source runs out (a small source repeats,
as a weight above its size asks). An epoch draws `data.mix_examples` examples (by default as
many as the sources hold together).

The sources are read whole, once, into memory (the columns data.style reads): mixtures are for
data sets a process holds, as fine-tuning's are; data beyond memory streams from data.train."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def draw(sizes: Sequence[int], weights: Sequence[float], n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the source of each of `n` examples, its row in that source)."""
    total = float(sum(weights))
    share = np.asarray(weights, dtype=np.float64) / total
    taken: np.ndarray = np.zeros(len(sizes), dtype=np.int64)
    sources: np.ndarray = np.empty(n, dtype=np.int64)
    for k in range(n):
        i = int(np.argmax(share * (k + 1) - taken))  # the most behind its share; the first of ties
        sources[k] = i
        taken[i] += 1
    rows: np.ndarray = np.empty(n, dtype=np.int64)
    for i, size in enumerate(sizes):
        at = np.flatnonzero(sources == i)
        passes = -(-len(at) // size) if size else 0
        order = np.concatenate(
            [np.random.default_rng([seed, i, p]).permutation(size) for p in range(passes)]
        ) if passes else np.zeros(0, dtype=np.int64)  # fmt: skip
        rows[at] = order[: len(at)]
    return sources, rows


def read_columns(paths: Any, fmt: str, columns: list[str], key: str) -> dict[str, np.ndarray]:
    """Every row of `paths`' files (local or s3://), the `columns` only, as object arrays."""
    from raylane.loop.data import files

    fs, found = files.list_files(paths, fmt, key)
    out: dict[str, list[Any]] = {c: [] for c in columns}
    for path in found:
        for chunk in files.read_chunks(fs, files.Piece(path), fmt, columns):
            for c in columns:
                out[c].extend(chunk[c].tolist())
    arrays: dict[str, np.ndarray] = {}
    for c, values in out.items():
        arrays[c] = np.empty(len(values), dtype=object)
        arrays[c][:] = values
    return arrays


def mixed_rows(cfg: Any, columns: list[str]) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, list[int]]:
    """The rows of an epoch of `cfg.data.mix`, drawn (every source read whole): (the rows, each
    one's source, its row in the source, the examples each source gave)."""
    d = cfg.data
    sources = [read_columns(s.train, d.format, columns, f"data.mix.{i}.train") for i, s in enumerate(d.mix)]
    sizes = [len(next(iter(s.values()))) for s in sources]
    for i, size in enumerate(sizes):
        if not size:
            raise ValueError(f"data.mix.{i}.train = {d.mix[i].train!r}: no rows in its files")
    n = d.mix_examples or sum(sizes)
    which, rows = draw(sizes, [s.weight for s in d.mix], n, cfg.train.seed)
    batch: dict[str, np.ndarray] = {c: np.empty(n, dtype=object) for c in columns}
    for i, source in enumerate(sources):
        at = which == i
        for c in columns:
            batch[c][at] = source[c][rows[at]]
    return batch, which, rows, np.bincount(which, minlength=len(sources)).tolist()


def name_of(mix: Sequence[Any], i: int) -> str:
    return mix[i].name or f"source {i}"


def tally_name(mix: Sequence[Any], i: int) -> str:
    """The source's name as a metric's (MLflow takes letters, digits and `_-. /`)."""
    import re

    return re.sub(r"[^\w.\- ]", "_", name_of(mix, i))
