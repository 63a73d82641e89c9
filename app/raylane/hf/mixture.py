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

A source is files (`train`: local or s3://) or a `datasets.Dataset` that a pipeline's own
`build(cfg)` hands to raylane.hf.pipeline(cfg, train={name: dataset}): a source without `train`
takes the dataset of its `name`. The sources are read whole, once, into memory (the columns
data.style reads): mixtures are for data sets a process holds, as fine-tuning's are; data beyond
memory streams from data.train."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def source_key(mix: Sequence[Any], i: int) -> str:
    """How a bad row's place, or an empty source, names source `i`: its files' key, or the
    dataset it takes."""
    return f"data.mix.{i}.train" if mix[i].train is not None else f"data.mix.{i} (dataset {mix[i].name!r})"


def handed_datasets(mix: Sequence[Any], handed: Mapping[str, Any]) -> list[Any]:
    """Each source's dataset (None for a source of files): a source without `train` takes the
    dataset handed to raylane.hf.pipeline(cfg, train={name: dataset}) under its name. The names
    are matched before anything is read, each mismatch one line (ConfigError)."""
    from raylane.config import ConfigError

    given = ", ".join(repr(name) for name in handed) or "none"
    names = [s.name for s in mix]
    for name in handed:
        if name not in names:
            known = ", ".join(repr(n) for n in names if n) or "none named"
            raise ConfigError(
                f"raylane.hf.pipeline(cfg, train={{{name!r}: ...}}): no data.mix source is named {name!r} "
                f"(the sources: {known})"
            )
    out: list[Any] = []
    for i, s in enumerate(mix):
        if s.train is not None and s.name in handed:
            raise ConfigError(
                f"data.mix.{i}: train = {s.train!r} and a dataset named {s.name!r} handed to raylane.hf.pipeline: "
                "give one"
            )
        if s.train is None and s.name not in handed:
            raise ConfigError(
                f"data.mix.{i}: no train, and no dataset named {s.name!r} handed to "
                f"raylane.hf.pipeline(cfg, train={{name: dataset}}) (handed in: {given})"
            )
        out.append(handed[s.name] if s.train is None else None)
    return out


def dataset_columns(cfg: Any, datasets: Sequence[Any] | None) -> list[str] | None:
    """The first dataset source's columns, which resolve data.style auto where no source has
    files (their check resolves it: raylane.hf.config.check_columns); None: no such dataset."""
    if cfg.data.style != "auto" or cfg.data.format == "text":
        return None
    for ds in datasets or ():
        if ds is not None and getattr(ds, "column_names", None):
            return list(ds.column_names)
    return None


def read_dataset(dataset: Any, columns: Mapping[str, str], key: str) -> dict[str, np.ndarray]:
    """Every row of a `datasets.Dataset` (or any table whose columns read as `dataset[column]`),
    the `columns` only (the batch's name -> the dataset's), as object arrays."""
    from raylane.config import ConfigError

    names = list(getattr(dataset, "column_names", None) or [])
    for column in columns.values():
        if names and column not in names:
            raise ConfigError(f"{key}: no column {column!r} in the dataset (it has: {', '.join(names)})")
    return {c: objects(dataset[column]) for c, column in columns.items()}


def read_columns(paths: Any, fmt: str, columns: list[str], key: str) -> dict[str, np.ndarray]:
    """Every row of `paths`' files (local or s3://), the `columns` only, as object arrays."""
    from raylane.loop.data import files

    fs, found = files.list_files(paths, fmt, key)
    out: dict[str, list[Any]] = {c: [] for c in columns}
    for path in found:
        for chunk in files.read_chunks(fs, files.Piece(path), fmt, columns):
            for c in columns:
                out[c].extend(chunk[c].tolist())
    return {c: objects(values) for c, values in out.items()}


def objects(values: Any) -> np.ndarray:
    """A column as an object array, row for row (np.array would make a list of lists 2-D)."""
    values = list(values)
    out: np.ndarray = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def mixed_rows(
    cfg: Any, columns: list[str], datasets: Sequence[Any] | None = None
) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, list[int]]:
    """The rows of an epoch of `cfg.data.mix`, drawn (every source read whole): (the rows, each
    one's source, its row in the source, the examples each source gave). `datasets`: each
    source's dataset, None for a source of files (handed_datasets)."""
    d = cfg.data
    datasets = datasets or [None] * len(d.mix)
    # A dataset's text is data.text_column even where data.format 'text' names the files' lines `text`.
    named = {c: d.text_column if d.format == "text" and c == "text" else c for c in columns}
    sources = [
        read_columns(s.train, d.format, columns, f"data.mix.{i}.train")
        if ds is None
        else read_dataset(ds, named, source_key(d.mix, i))
        for i, (s, ds) in enumerate(zip(d.mix, datasets, strict=True))
    ]
    sizes = [len(next(iter(s.values()))) for s in sources]
    for i, size in enumerate(sizes):
        if not size:
            where = f" = {d.mix[i].train!r}: no rows in its files" if d.mix[i].train is not None else ": no rows"
            raise ValueError(f"{source_key(d.mix, i)}{where}")
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
