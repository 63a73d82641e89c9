"""Data beyond memory: a pipeline's `train_set` (and `eval_set`) may be a `FileSource`, files read
as a stream instead of a map-style Dataset held in memory.

On Ray, `raylane.onray.datasets` turns the source into Ray Data (read + `map_batches(transform)`
on Ray Data's own CPU tasks) and Ray Train splits it across the workers. Under torchrun and in
one process, `FileStream` below reads it with pyarrow: each rank reads only its own share of the
pieces (Parquet row groups, or whole CSV / JSON Lines / text files), the share drawn anew each
epoch from the seed, and every rank runs the same number of batches (DDP would hang otherwise).

Resume: the pyarrow stream depends only on (seed, epoch, rank, world size), so a resume
mid-epoch skips exactly the batches already consumed. Ray Data's row order is not reproducible:
there the guarantee is per epoch (see `raylane.onray.datasets`)."""

from __future__ import annotations

import itertools
import json
import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from raylane.loop.data import baddata
from raylane.loop.data import files as _files

Batch = dict[str, np.ndarray]
FORMATS = ("parquet", "csv", "json", "text")
PREFETCH_BATCHES = 4


@dataclass(frozen=True)
class FileSource:
    """Files to stream, and how a batch of their rows becomes tensors. Ray-free and declarative:
    the same object drives Ray Data on Ray and pyarrow elsewhere.

    - `paths`: a file, a directory (searched recursively for the format's extension), a glob, or
      a list of them; local or `s3://bucket/prefix`.
    - `format`: parquet, csv, json (JSON Lines: one object per line) or text (one row per
      non-empty line, in a column named `text`).
    - `columns`: the columns to read (None: all).
    - `transform`: batch dict of numpy arrays -> batch dict; preprocessing that runs where the
      data is read (Ray Data's `map_batches` tasks on Ray, the rank's reader thread elsewhere).
      Must be deterministic. `keeps_rows=False` when it changes the number of rows (windowing
      text, filtering): batch counts are then found by a counting pass over the files.
    - `to_tensors`: batch dict -> (inputs, targets), run on the rank for each batch.
    - `shuffle_rows`: rows of the shuffle buffer (train only), on top of a per-epoch file order.
    - `key`: the config key its paths come from (`data.train`), for messages about its data.
      A transform raises `raylane.DataError` for a bad value: the reader names the file and row.
    - `skip_bad_rows`: False, the first such DataError fails the run; True, the rows the
      DataErrors name are dropped (and the rest of the batch transformed again); N, at most N
      of them. Rows are then counted before training, where the skipped ones are counted too.
    """

    paths: str | Sequence[str]
    to_tensors: Callable[[Batch], tuple[Any, Any]]
    format: Literal["parquet", "csv", "json", "text"] = "parquet"
    columns: Sequence[str] | None = None
    transform: Callable[[Batch], Batch] | None = None
    keeps_rows: bool = True
    shuffle_rows: int = 4096
    key: str | None = None
    skip_bad_rows: bool | int = False

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"FileSource.format = {self.format!r}: choose one of {', '.join(FORMATS)}")
        if not callable(self.to_tensors):
            raise ValueError("FileSource.to_tensors: must be a function batch -> (inputs, targets)")
        if not isinstance(self.skip_bad_rows, (bool, int)) or self.skip_bad_rows < 0:
            raise ValueError(f"FileSource.skip_bad_rows = {self.skip_bad_rows!r}: True, False or a row count")

    @property
    def counts_rows(self) -> bool:
        """Whether rows per epoch are found by reading the files (a transform that changes the
        row count, or bad rows skipped) rather than from Parquet footers."""
        return not self.keeps_rows or bool(self.skip_bad_rows)

    def files(self, field: str = "paths", quick: bool = False):
        """(pyarrow filesystem, sorted files); ValueError naming `field` when nothing is there.
        `quick`: for a check before the run (object storage without the SDK's retries)."""
        return _files.list_files(self.paths, self.format, field, quick)

    @property
    def label(self) -> str:
        """How messages name this source's data: its config key, else its paths."""
        return self.key or f"paths = {self.paths!r}"

    def check(self, field: str = "paths") -> None:
        """For a pipeline's config validator: the files exist, the first can be read (a Parquet
        file's footer too) and has `columns` (one chunk read); else ValueError naming `field`."""
        fs, found = self.files(field, quick=True)
        _files.pieces(fs, found[:1], self.format, field)
        if self.columns:
            names = _files.schema_names(fs, found[0], self.format, field)
            missing = [c for c in self.columns if c not in names]
            if missing:
                raise ValueError(
                    f"{field} = {self.paths!r}: no column {missing[0]!r} in {found[0]} (it has: {', '.join(names)})"
                )

    def sample(self, field: str = "paths", *, transformed: bool = False) -> Batch:
        """The first chunk of the first file, raw (or `transformed`: a DataError of the transform
        then names its row): for a config validator to check the data before any worker starts."""
        fs, found = self.files(field)
        chunks = _files.checked_chunks(
            fs,
            _files.Piece(found[0]),
            self.format,
            self.columns,
            self.checked_transform() if transformed else None,
            field,
            baddata.Skipped() if transformed and self.skip_bad_rows else None,
        )
        return next(chunks, {})

    def stream_transform(self) -> Callable[[Batch], Batch] | None:
        """What Ray Data's tasks apply: the checked transform, dropping bad rows when they are
        skipped (counted by the driver's counting pass, `tally`, not here)."""
        fn = self.checked_transform()
        if fn is None or not self.skip_bad_rows:
            return fn
        return lambda batch: baddata.skipping(fn, batch)[0]

    def tally(self, batch: Batch) -> Batch:
        """A counting pass's view of one batch (Ray Data's tasks): one row of the rows read, the
        rows the transform gives, the rows skipped and the first one's line (its place unknown),
        and the transform's own counts (JSON)."""
        counts: dict[str, int] = {}
        fn = self.checked_transform(counts)
        out, dropped, first = baddata.skipping(fn, batch) if fn is not None else (batch, 0, None)
        return {
            "read": np.array([num_rows(batch)]),
            "kept": np.array([num_rows(out)]),
            "skipped": np.array([dropped]),
            "first": np.array(["" if first is None else baddata.skipped_line(first)], dtype=object),
            "counts": np.array([json.dumps(counts)], dtype=object),
        }

    def checked_transform(self, counts: dict[str, int] | None = None) -> Callable[[Batch], Batch] | None:
        """The transform, its counts (`COUNT`) taken out of its rows (added to `counts` when
        given: a counting pass's), failing loudly when it changes the row count while keeps_rows
        says not: the batch counts every rank agreed on would be wrong, and DDP would hang."""
        fn = self.transform
        if fn is None:
            return None

        def checked(batch: Batch) -> Batch:
            out, found = split_counts(fn(batch))
            if counts is not None:
                for name, n in found.items():
                    counts[name] = counts.get(name, 0) + n
            if self.keeps_rows and num_rows(out) != num_rows(batch):
                raise ValueError(
                    f"FileSource.transform turned {num_rows(batch)} rows into {num_rows(out)}: "
                    "set keeps_rows=False for a transform that changes the number of rows"
                )
            return out

        return checked


# A transform's counts of a batch, beside its rows: `{"count:<what>": np.array([n])}` (examples cut
# to a sequence, say). Taken out before the rows go on (Ray Data's blocks, the tensors), summed by
# the counting pass before training and recorded for the summary with the source's skipped rows.
COUNT = "count:"


def split_counts(out: Batch) -> tuple[Batch, dict[str, int]]:
    """(a transform's rows, its counts)."""
    if not any(k.startswith(COUNT) for k in out):
        return out, {}
    counts = {k.removeprefix(COUNT): int(np.sum(v)) for k, v in out.items() if k.startswith(COUNT)}
    return {k: v for k, v in out.items() if not k.startswith(COUNT)}, counts


def num_rows(batch: Batch) -> int:
    return len(next(iter(batch.values()))) if batch else 0


def _concat(chunks: list[Batch]) -> Batch:
    return chunks[0] if len(chunks) == 1 else {k: np.concatenate([c[k] for c in chunks]) for k in chunks[0]}


def _slice(batch: Batch, start: int, stop: int) -> Batch:
    return {k: v[start:stop] for k, v in batch.items()}


def rebatch(
    chunks: Iterator[Batch], batch_size: int, rng: np.random.Generator | None, buffer_rows: int
) -> Iterator[Batch]:
    """Chunks of any size -> batches of `batch_size` (the last may be short), rows shuffled
    within a buffer of about `buffer_rows` when `rng` is given."""
    pending: list[Batch] = []
    held = 0
    for chunk in chunks:
        if num_rows(chunk):
            pending.append(chunk)
            held += num_rows(chunk)
        if held >= max(buffer_rows, batch_size):
            buf = _concat(pending)
            if rng is not None:
                buf = {k: v[order] for order in [rng.permutation(held)] for k, v in buf.items()}
            full = held - held % batch_size
            yield from (_slice(buf, s, s + batch_size) for s in range(0, full, batch_size))
            pending, held = ([_slice(buf, full, held)] if held > full else []), held - full
    if held:
        buf = _concat(pending)
        if rng is not None:
            buf = {k: v[order] for order in [rng.permutation(held)] for k, v in buf.items()}
        yield from (_slice(buf, s, s + batch_size) for s in range(0, held, batch_size))


def prefetched(batches: Iterator[Any], depth: int = PREFETCH_BATCHES) -> Iterator[Any]:
    """`batches` produced on a thread, `depth` ahead: pyarrow's reads and decoding release the
    GIL, so they overlap the rank's compute. Closing the iterator stops the thread."""
    items: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(item: tuple[str, Any]) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not put(("batch", batch)):
                    return
            put(("end", None))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the consumer's thread
            put(("error", exc))

    threading.Thread(target=produce, name="raylane-reader", daemon=True).start()
    try:
        while True:
            kind, value = items.get()
            if kind == "end":
                return
            if kind == "error":
                raise value
            yield value
    finally:
        stop.set()


class _Reader:
    """What FileStream and FileEvalStream share: the files, as pieces, and their chunks."""

    def __init__(self, source: FileSource, *, batch_size: int, rank: int, world_size: int) -> None:
        self.source, self.batch_size = source, batch_size
        self.rank, self.world_size = rank, world_size
        self.fs, found = source.files()
        self.pieces = _files.pieces(self.fs, found, source.format, source.label)
        self._transform = source.checked_transform()
        self.opened: list[_files.Piece] = []  # pieces this rank read, in order (what tests check)
        # Training and evaluation drop bad rows again each epoch: counted once, by `counted`.
        self._dropped = baddata.Skipped() if source.skip_bad_rows else None

    def chunks(
        self, piece: _files.Piece, tally: baddata.Skipped | None = None, transform: Callable | None = None
    ) -> Iterator[Batch]:
        self.opened.append(piece)
        return _files.checked_chunks(
            self.fs,
            piece,
            self.source.format,
            self.source.columns,
            transform or self._transform,
            self.source.label,
            tally if tally is not None else self._dropped,
        )

    def counted(self) -> list[int]:
        """Rows of every piece after the transform, read once: each rank counts a stride of the
        pieces and the counts are exchanged (one all_gather_object, before training). Bad rows
        skipped are recorded for the summary (raylane.loop.data.baddata.record_skipped), and more
        than skip_bad_rows allows fails every rank alike."""
        skip = bool(self.source.skip_bad_rows)
        mine: dict[int, tuple[int, baddata.Skipped | None, dict[str, int]]] = {}
        for i in range(self.rank, len(self.pieces), self.world_size):
            tally = baddata.Skipped() if skip else None
            counts: dict[str, int] = {}
            chunks = self.chunks(self.pieces[i], tally, self.source.checked_transform(counts))
            mine[i] = (sum(num_rows(c) for c in chunks), tally, counts)
        self.opened.clear()  # counting is not the epoch's reading
        if self.world_size > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, mine)
            mine = {i: n for part in gathered for i, n in part.items()}
        total = baddata.Skipped()
        for i in range(len(self.pieces)):  # in file order: the first line is the first row skipped
            total.add(mine[i][1] or baddata.Skipped(), mine[i][2])
        if skip or total.counts:
            baddata.record_skipped(self.source.label, total, self.source.skip_bad_rows)
        return [mine[i][0] for i in range(len(self.pieces))]


class FileStream(_Reader):
    """A rank's training share of a FileSource, read with pyarrow; the `EpochData` the Trainer
    iterates (see raylane.loop.data.loader). The pieces are dealt round-robin from a permutation drawn
    from (seed, epoch); every rank runs as many batches as the smallest share makes."""

    epochs_alike = False

    def __init__(self, source: FileSource, *, batch_size: int, rank: int, world_size: int, seed: int) -> None:
        super().__init__(source, batch_size=batch_size, rank=rank, world_size=world_size)
        if len(self.pieces) < world_size:
            raise ValueError(
                f"paths = {source.paths!r}: {len(self.pieces)} piece(s) (Parquet row groups or "
                f"files) for {world_size} ranks; each rank reads whole pieces: give at least "
                "as many files or row groups as ranks"
            )
        self.seed = seed
        self.rows = self._count_rows()
        self._batches: dict[int, int] = {}
        self.epoch, self.skip_batches = 0, 0

    def _count_rows(self) -> list[int]:
        """Rows of every piece after the transform: Parquet footers when the transform keeps
        rows, else a counting pass (`counted`)."""
        if not self.source.counts_rows and all(p.rows is not None for p in self.pieces):
            return [p.rows for p in self.pieces]
        return self.counted()

    def share(self, epoch: int, rank: int) -> list[int]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.pieces))
        return order[rank :: self.world_size].tolist()

    def batches_in_epoch(self, epoch: int) -> int:
        if epoch not in self._batches:
            self._batches[epoch] = min(
                math.ceil(sum(self.rows[i] for i in self.share(epoch, r)) / self.batch_size)
                for r in range(self.world_size)
            )
        return self._batches[epoch]

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch, self.skip_batches = epoch, skip_batches

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        epoch, wanted = self.epoch, self.batches_in_epoch(self.epoch)
        rng = np.random.default_rng([self.seed, epoch, self.rank, 1])
        chunks = itertools.chain.from_iterable(self.chunks(self.pieces[i]) for i in self.share(epoch, self.rank))
        batches = itertools.islice(
            rebatch(chunks, self.batch_size, rng, self.source.shuffle_rows), self.skip_batches, wanted
        )  # skipped batches never become tensors
        return prefetched(self.source.to_tensors(b) for b in batches)


class FileEvalStream(_Reader):
    """A rank's evaluation share, read with pyarrow in file order: pieces rank, rank + world, ...
    Every row is evaluated exactly once over all ranks; shares need not be equal."""

    def __init__(self, source: FileSource, *, batch_size: int, rank: int, world_size: int) -> None:
        super().__init__(source, batch_size=batch_size, rank=rank, world_size=world_size)
        if source.skip_bad_rows:  # counted before training, as the training set is
            self.counted()

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        mine = self.pieces[self.rank :: self.world_size]
        chunks = itertools.chain.from_iterable(self.chunks(p) for p in mine)
        return prefetched(self.source.to_tensors(b) for b in rebatch(chunks, self.batch_size, None, 0))


LOCATE_BUDGET_S = 60.0


def locate(source: FileSource, budget_s: float = LOCATE_BUDGET_S) -> BaseException | None:
    """The first failure reading `source` with pyarrow, piece by piece in file order, transform
    included: what Ray Data's tasks failed on, found again with its place. None when nothing
    fails, or when `budget_s` runs out first."""
    import time

    deadline = time.monotonic() + budget_s
    try:
        reader = _Reader(source, batch_size=1, rank=0, world_size=1)
        for piece in reader.pieces:
            for _ in reader.chunks(piece):
                if time.monotonic() > deadline:
                    return None
    except Exception as exc:  # noqa: BLE001 - what was looked for
        return exc
    return None
