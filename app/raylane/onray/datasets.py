"""Streaming sources on Ray: a pipeline's `FileSource` becomes Ray Data on the driver (read +
`map_batches(transform)`, run by Ray Data's own CPU tasks beside the ranks), handed to the
TorchTrainer as `datasets=`, and split across the workers by Ray Train.

The driver learns a pipeline's sources from its `sources(cfg)` function, without building the
model or loading anything else; a pipeline that streams without declaring `sources` is read by
each rank with pyarrow, as under torchrun.

What a run on Ray Data guarantees: "train" is split with `streaming_split(equal=True)`, so every
rank runs the same number of batches and each epoch gives every row to exactly one rank (all but
fewer than world-size rows, which the equal split leaves out of that epoch). The order of rows is
Ray Data's own (file order shuffled each epoch, a local shuffle buffer, tasks finishing in any
order) and cannot be replayed: a checkpoint at an epoch end resumes at the next epoch; a resume
mid-epoch skips as many batches as were run, but of a fresh read, so in that one epoch some rows
may be seen twice and others not at all. "eval" is split unequally: every row exactly once."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import ray.data
import ray.train
from ray.train import DataConfig

from raylane import pipelines_ref
from raylane.config import BaseConfig
from raylane.loop.data import baddata
from raylane.loop.data import files as _files
from raylane.loop.data.streaming import FileSource, locate

READ_PREFETCH_BATCHES = 2


def build_datasets(cfg: BaseConfig) -> tuple[dict[str, ray.data.Dataset], dict[str, int | None]]:
    """(Ray Datasets by name, and for each its rows per epoch before the split: "train" only)."""
    # Ray Train hands the driver's DataContext to the workers: no progress bars in the run's log
    # (the driver's display shows progress), no banner at each epoch's execution.
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars, ctx.print_on_execution_start = False, False
    datasets, streams = {}, {}
    for name, source in _named(pipelines_ref.sources(cfg)).items():
        if isinstance(source, FileSource):
            datasets[name], counted = _to_dataset(source, name, train=name == "train")
            rows = counted() if name == "train" or source.skip_bad_rows else None  # skipped rows: counted
            streams[name] = rows if name == "train" else None
    return datasets, streams


def _named(sources: dict[str, Any]) -> dict[str, Any]:
    """Named held-out sets ("eval": {name: FileSource}) as datasets "eval.<name>", each split
    on its own (raylane.loop.data.loader.eval_data asks for them by that name)."""
    out = {k: v for k, v in sources.items() if not (k == "eval" and isinstance(v, dict))}
    for name, source in (sources.get("eval") if isinstance(sources.get("eval"), dict) else {}).items():
        out[f"eval.{name}"] = source
    return out


def _to_dataset(source: FileSource, name: str, *, train: bool):
    fs, found = source.files(f"{name} source paths")
    fmt, columns = source.format, list(source.columns) if source.columns else None
    common = {"filesystem": fs, "file_extensions": None, "shuffle": "files" if train else None}
    if fmt == "parquet":
        ds = ray.data.read_parquet(found, columns=columns, **common)
    elif fmt == "csv":
        import pyarrow.csv as pacsv

        ds = ray.data.read_csv(
            found, convert_options=pacsv.ConvertOptions(include_columns=columns) if columns else None, **common
        )
    elif fmt == "json":
        # pyarrow reads JSON Lines (one object per line); lines=True (Ray 2.60) refuses a filesystem.
        ds = ray.data.read_json(found, **common)
        ds = ds.select_columns(columns) if columns else ds
    else:
        ds = ray.data.read_text(found, **common)
    read = ds
    transform = source.stream_transform()
    if transform is not None:
        ds = ds.map_batches(transform, batch_format="numpy")

    def counted() -> int:
        # Parquet footers when the transform keeps rows (no Ray Data task); else Ray Data counts,
        # reading (and transforming) the files once, in parallel.
        if not source.counts_rows and fmt == "parquet":
            return sum(p.rows for p in _files.pieces(fs, found, fmt, source.label))
        try:
            if source.keeps_rows and not source.skip_bad_rows:
                return read.count()
            # One row a batch: the rows kept, skipped and the transform's counts, in one pass.
            tallies = read.map_batches(source.tally, batch_format="numpy").take_all()
        except Exception as exc:
            raise _found_again(source, exc) from exc
        return _skipped(source, tallies)

    return ds, counted


def _skipped(source: FileSource, tallies: list[dict[str, Any]]) -> int:
    """Rows after the transform, bad ones skipped, from a counting pass of Ray Data's tasks that
    tallied each batch to one row (raylane.loop.data.streaming.FileSource.tally). What was skipped is
    recorded for the summary (more than skip_bad_rows allows: a DataError, before the workers
    start); the first row skipped is found again, with its file and row, by reading the files in
    order with pyarrow up to it (a search bounded in time)."""
    total = baddata.Skipped(rows=sum(int(t["read"]) for t in tallies), skipped=sum(int(t["skipped"]) for t in tallies))
    for t in tallies:
        total.add(baddata.Skipped(), json.loads(t["counts"]))
    if not (source.skip_bad_rows or total.counts):
        return sum(int(t["kept"]) for t in tallies)
    if total.skipped:
        found = locate(dataclasses.replace(source, skip_bad_rows=False))
        if isinstance(found, baddata.DataError):
            total.first = baddata.skipped_line(found)
        else:  # not found in the time given: the line without its place
            total.first = next(t["first"] for t in tallies if t["first"])
    baddata.record_skipped(source.label, total, source.skip_bad_rows)
    return sum(int(t["kept"]) for t in tallies)


class StreamSplit(DataConfig):
    """Ray Train's DataConfig, but "eval" split unequally: equal splits (which "train" needs, so
    that every rank runs the same number of steps) would leave rows out of the held-out metrics."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        output: list[dict[str, Any]] = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            if ds.name is None:
                ds.set_name(name)
            ds = ds.copy(ds)
            ds.context.execution_options = self._resolve_execution_options(name)
            hints = worker_node_ids if self._enable_shard_locality else None
            for i, split in enumerate(ds.streaming_split(world_size, equal=name == "train", locality_hints=hints)):
                output[i][name] = split
        return output


class RayShardStream:
    """A worker's split of the "train" Ray Dataset, as the loop's EpochData."""

    epochs_alike = True

    def __init__(self, shard: Any, source: FileSource, *, batch_size: int, rows: int, world_size: int) -> None:
        self.shard, self.source, self.batch_size, self.rows = shard, source, batch_size, rows
        self.batches = math.ceil(rows // world_size / batch_size)  # the equal split's share
        self.epoch, self.skip_batches = 0, 0

    def batches_in_epoch(self, epoch: int) -> int:
        return self.batches

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch, self.skip_batches = epoch, skip_batches

    def __iter__(self):
        seen = 0
        for batch in batches(
            self.shard, self.source, batch_size=self.batch_size, local_shuffle_buffer_size=self.source.shuffle_rows
        ):
            if seen == self.batches:
                break
            seen += 1
            if seen > self.skip_batches:  # skipped batches are read, never turned into tensors
                yield self.source.to_tensors(batch)
        if seen < self.batches:
            raise RuntimeError(
                f"Ray Data gave rank {ray.train.get_context().get_world_rank()} {seen} batches "
                f"in epoch {self.epoch + 1}, not the {self.batches} every rank agreed on"
            )


class RayEvalStream:
    """A worker's split of the "eval" Ray Dataset: all of its rows, every epoch."""

    def __init__(self, shard: Any, source: FileSource, *, batch_size: int) -> None:
        self.shard, self.source, self.batch_size = shard, source, batch_size

    def __iter__(self):
        for batch in batches(self.shard, self.source, batch_size=self.batch_size):
            yield self.source.to_tensors(batch)


def batches(shard: Any, source: FileSource, **options: Any):
    """A shard's numpy batches. Ray Data's failure (a task's error as text, in colour, wrapped
    in Ray's exceptions, on every rank) becomes the failure itself: a DataError with its file
    and row, or the exception of the user's transform, with its place."""
    try:
        yield from shard.iter_batches(batch_format="numpy", prefetch_batches=READ_PREFETCH_BATCHES, **options)
    except Exception as exc:
        raise _found_again(source, exc) from exc


def _found_again(source: FileSource, exc: BaseException) -> BaseException:
    """What Ray Data failed on, read again with pyarrow (raylane.loop.data.streaming.locate), else
    one line from Ray's text: the original exception's, without Ray's wrappers and colours."""
    found = locate(source)
    if found is not None:
        return found
    return RuntimeError(f"{source.label}: Ray Data could not read the data: {baddata.cause_line(str(exc))}")


def shard_stream(name: str, source: FileSource, streams: dict[str, int | None], *, batch_size: int, world_size: int):
    """The loop's reader of dataset `name` (one the driver made) on this worker."""
    shard = ray.train.get_dataset_shard(name)
    if name == "train":
        return RayShardStream(shard, source, batch_size=batch_size, rows=streams[name], world_size=world_size)
    return RayEvalStream(shard, source, batch_size=batch_size)
