"""Data loading: a DistributedSampler for every world size (1 included), so the order of samples
depends only on the seed, the epoch and the world size, and a resumed epoch can skip exactly the
batches it already ran. With train.global_batch, a `GlobalOrderSampler` instead: the order
depends on the seed and the epoch alone, and a resume on another world size continues the
epoch at the same sample.

The Trainer iterates any `EpochData`: this module's `EpochLoader` for map-style datasets, or a
stream of a `raylane.loop.data.streaming.FileSource` (pyarrow's `FileStream`, or the launcher's own,
Ray Data's shard on Ray)."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, SequentialSampler, Subset

from raylane.loop.distributed.devices import local_world_size
from raylane.loop.distributed.layout import Layout


class EpochData(Protocol):
    """Training batches, epoch by epoch: the same number of batches on every rank."""

    # Every epoch has as many batches as the first (plan_steps then needs no walk over epochs).
    epochs_alike: bool

    def batches_in_epoch(self, epoch: int) -> int:
        """Batches of `epoch` in full, skipped ones included."""

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """The next iteration yields `epoch`'s batches, less its first `skip_batches`."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way through, at a batch boundary."""

    def __init__(self, dataset: Dataset, *, batch_size: int, **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.batch_size = batch_size
        self.skip_batches = 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip_batches * self.batch_size :])

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip_batches * self.batch_size)


class GlobalOrderSampler(Sampler[int]):
    """An epoch as one permutation of the whole dataset (seeded by seed and epoch alone: the same
    at any world size), taken `samples_per_step` at a time; each rank takes its contiguous share
    of every step's samples, as its micro-batches in order. The epoch's last partial step is
    dropped. The position is a number of steps, so a run resumed on another world size, with
    the same samples per step, continues at the same sample: none skipped, none repeated."""

    def __init__(
        self, n: int, *, samples_per_step: int, batch_size: int, rank: int, world_size: int, seed: int
    ) -> None:
        self.n, self.samples_per_step, self.batch_size = n, samples_per_step, batch_size
        self.per_rank = samples_per_step // world_size
        self.rank, self.seed = rank, seed
        self.steps = n // samples_per_step
        if self.steps == 0:
            raise ValueError(
                f"train.global_batch = {samples_per_step}: more than the {n} training samples; "
                "an epoch would have no step"
            )
        self.epoch, self.skip_steps = 0, 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch = epoch
        self.skip_steps = skip_batches * self.batch_size // self.per_rank

    @property
    def num_samples(self) -> int:  # this rank's samples in a whole epoch
        return self.steps * self.per_rank

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        start = self.rank * self.per_rank
        for step in range(self.skip_steps, self.steps):
            first = step * self.samples_per_step + start
            yield from order[first : first + self.per_rank]

    def __len__(self) -> int:
        return (self.steps - self.skip_steps) * self.per_rank


class EpochLoader(DataLoader):
    """A DataLoader over a ResumableSampler (or a GlobalOrderSampler): EpochData for map-style
    datasets. Iterating it is plain DataLoader iteration (the per-step hot path is unchanged).

    With worker processes, each batch is loaded with the random generators of its worker seeded
    from (seed, rank, epoch, batch): a random augmentation in `__getitem__` or `collate_fn` draws
    the same numbers in a resumed epoch as in an uninterrupted one, whichever worker loads the
    batch. In the rank's own process (no workers) it draws from the rank's generators, which the
    checkpoint holds."""

    epochs_alike = True

    def __init__(
        self,
        dataset: Dataset,
        *,
        sampler: Sampler[int],
        batch_size: int,
        seed: int,
        rank: int,
        whole_batches: bool = False,
        **options: Any,
    ) -> None:
        super().__init__(**_batching(dataset, sampler, batch_size, (seed, rank, 0), options, whole_batches))
        self.order, self.rows_per_batch, self.whole_batches = sampler, batch_size, whole_batches
        self.batches = self.batch_sampler if isinstance(self.batch_sampler, _SeededBatches) else None

    def batches_in_epoch(self, epoch: int) -> int:
        if self.whole_batches:  # the last, partial batch is left out
            return self.order.num_samples // self.rows_per_batch
        return math.ceil(self.order.num_samples / self.rows_per_batch)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.order.set_epoch(epoch, skip_batches=skip_batches)
        if self.batches is not None:
            self.batches.set_epoch(epoch, skip_batches)


def _batching(
    dataset: Dataset,
    sampler: Sampler[int],
    batch_size: int,
    key: tuple[int, ...],
    options: dict[str, Any],
    whole: bool = False,
) -> dict[str, Any]:
    """DataLoader keywords: with workers, batches tagged with `key` (seed, rank, train or
    held-out), the epoch and their place in it, for the worker to seed its generators from.
    `whole`: only batches of `batch_size` rows (a pipeline schedule's shapes are fixed)."""
    if not options.get("num_workers"):
        return {"dataset": dataset, "batch_size": batch_size, "sampler": sampler, "drop_last": whole, **options}
    batches = _SeededBatches(sampler, batch_size, key, whole)
    return {"dataset": _SeededItems(dataset), "batch_sampler": batches, **options}


class _Batch(list):
    """A batch's indices, and the seed of the worker's generators while it is loaded."""

    seed: tuple[int, ...] = ()


class _SeededBatches(Sampler[list[int]]):
    """The sampler's indices in batches, each tagged with the key, the epoch and its place in the
    epoch: iterated in the rank's own process, so set_epoch holds with persistent workers."""

    def __init__(self, sampler: Sampler[int], batch_size: int, key: tuple[int, ...], whole: bool = False) -> None:
        self.sampler, self.batch_size, self.key, self.whole = sampler, batch_size, key, whole
        self.epoch, self.skip_batches = 0, 0

    def set_epoch(self, epoch: int, skip_batches: int) -> None:
        self.epoch, self.skip_batches = epoch, skip_batches

    def __iter__(self) -> Iterator[_Batch]:
        indices = iter(self.sampler)
        for place in itertools.count(self.skip_batches):
            batch = _Batch(itertools.islice(indices, self.batch_size))
            if not batch or (self.whole and len(batch) < self.batch_size):
                return
            batch.seed = (*self.key, self.epoch, place)
            yield batch

    def __len__(self) -> int:
        if self.whole:
            return len(self.sampler) // self.batch_size
        return math.ceil(len(self.sampler) / self.batch_size)


class _SeededItems(Dataset):
    """The dataset as a worker reads it: a batch's items, after seeding the worker's torch,
    numpy and python generators from the batch's tag (DataLoader's fetcher calls __getitems__)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: list[int]) -> list[Any]:
        if seed := getattr(batch, "seed", None):
            state = np.random.SeedSequence(list(seed)).generate_state(2, dtype=np.uint64)
            torch.manual_seed(int(state[0]))
            np.random.seed(int(state[1]) % 2**32)
            random.seed(int(state[1]))
        many = getattr(self.dataset, "__getitems__", None)
        return many(list(batch)) if many else [self.dataset[i] for i in batch]


def build_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    shuffle: bool,
    samples_per_step: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    options: dict[str, Any] | None = None,
    whole_batches: bool = False,
) -> EpochLoader:
    sampler: Sampler[int]
    if samples_per_step:
        sampler = GlobalOrderSampler(
            len(dataset),
            samples_per_step=samples_per_step,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            seed=seed,
        )
    else:
        sampler = ResumableSampler(
            dataset, batch_size=batch_size, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed
        )
    return EpochLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        seed=seed,
        rank=rank,
        whole_batches=whole_batches,
        **loader_options(seed, collate_fn, options),
    )


class DataRanks:
    """A runtime as the data sees it under tensor and pipeline parallelism: the ranks of a
    tensor-parallel group (`tp` consecutive ranks), and the stages of a pipeline (`pp` groups of
    ranks, outermost), read the same batches, so the data is split over the data-parallel ranks
    (the mesh's (dp_replicate, dp_shard)). A stream is read here, by group: the launcher's own (Ray
    Data's) splits by world rank."""

    def __init__(self, runtime: Any, layout: Layout) -> None:
        self.world_size = layout.data_parallel
        self.rank = layout.data_rank(runtime.rank)

    def data_stream(self, name: str, source: Any, *, batch_size: int) -> Any | None:
        return None


def data_ranks(runtime: Any, layout: Layout) -> Any:
    """`runtime`, or with tensor or pipeline parallelism in `layout` its DataRanks: what the loaders
    split the data by."""
    return runtime if layout.tp == layout.pp == 1 else DataRanks(runtime, layout)


def is_stream(data: Any) -> bool:
    from raylane.loop.data.streaming import FileSource

    return isinstance(data, FileSource)


def train_data(
    dataset: Any,
    runtime: Any,
    *,
    batch_size: int,
    seed: int,
    samples_per_step: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    options: dict[str, Any] | None = None,
    whole_batches: bool = False,
) -> EpochData:
    """The training batches of this rank: a map-style dataset's loader, or a FileSource's stream
    (the launcher's, when it made one: Ray Data on Ray; else read here with pyarrow). With
    `samples_per_step` (train.global_batch), the epoch's order is the same at any world size.
    `collate_fn` (the pipeline's) and `options` (`worker_options`) apply to a map-style dataset;
    a stream makes its batches with its FileSource's to_tensors. `whole_batches`: an epoch's last,
    partial batch is left out (a pipeline schedule runs batches of one shape)."""
    if not is_stream(dataset):
        return build_loader(
            dataset,
            batch_size=batch_size,
            rank=runtime.rank,
            world_size=runtime.world_size,
            seed=seed,
            shuffle=True,
            samples_per_step=samples_per_step,
            collate_fn=collate_fn,
            options=options,
            whole_batches=whole_batches,
        )
    if samples_per_step:
        raise ValueError(
            "train.global_batch: a streaming source's epochs are shared out by file, not by sample; "
            "leave train.global_batch unset for it"
        )
    from raylane.loop.data.streaming import FileStream

    return runtime.data_stream("train", dataset, batch_size=batch_size) or FileStream(
        dataset, batch_size=batch_size, rank=runtime.rank, world_size=runtime.world_size, seed=seed
    )


def eval_data(
    dataset: Any,
    runtime: Any,
    *,
    batch_size: int,
    seed: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    options: dict[str, Any] | None = None,
    stream: str = "eval",
) -> Any:
    """This rank's share of the held-out set, every sample in exactly one rank's share; for
    named sets ({name: dataset}), {name: its share}. `stream`: the launcher's name for a
    streaming set (named sets: "eval.<name>", see raylane.onray.datasets)."""
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        return {
            name: eval_data(
                data,
                runtime,
                batch_size=batch_size,
                seed=seed,
                collate_fn=collate_fn,
                options=options,
                stream=f"eval.{name}",
            )
            for name, data in dataset.items()
        }
    if is_stream(dataset):
        from raylane.loop.data.streaming import FileEvalStream

        return runtime.data_stream(stream, dataset, batch_size=batch_size) or FileEvalStream(
            dataset, batch_size=batch_size, rank=runtime.rank, world_size=runtime.world_size
        )
    shard = Subset(dataset, shard_indices(len(dataset), runtime.rank, runtime.world_size))
    # With workers, every evaluation loads the same batches alike (random augmentations too),
    # whatever ran before it: a resumed run's evaluations match an uninterrupted run's.
    return DataLoader(
        **_batching(
            shard,
            SequentialSampler(shard),
            batch_size,
            (seed, runtime.rank, 1),
            loader_options(seed, collate_fn, options),
        )
    )


def loader_options(
    seed: int, collate_fn: Callable[[list[Any]], Any] | None = None, options: dict[str, Any] | None = None
) -> dict[str, Any]:
    # Every iter() of a DataLoader draws a seed from its generator: a private one keeps the global
    # RNG (dropout) on the same sequence whether or not an epoch was resumed part-way. No options:
    # batches are loaded in the rank's own process.
    return {
        "num_workers": 0,
        **(options or {}),
        "collate_fn": collate_fn,
        "generator": torch.Generator().manual_seed(seed),
    }


def worker_options(loader: Any, device: torch.device) -> dict[str, Any]:
    """DataLoader keywords from the config's `loader` section, its nulls and auto chosen for
    `device`: workers on a GPU only (on CPU the rank's compute already uses the cores), pinned
    memory on a GPU, persistent workers when there are workers; prefetch_factor torch's own."""
    gpu = device.type == "cuda"
    workers = loader.num_workers
    if workers == "auto":
        workers = min(4, max(0, cores() // local_world_size() - 1)) if gpu else 0
    options: dict[str, Any] = {
        "num_workers": workers,
        "pin_memory": gpu if loader.pin_memory is None else loader.pin_memory,
    }
    if workers:
        options["persistent_workers"] = True if loader.persistent_workers is None else loader.persistent_workers
        if loader.prefetch_factor is not None:
            options["prefetch_factor"] = loader.prefetch_factor
    return options


def cores() -> int:
    """The cores this process may run on (its affinity: a container's or a scheduler's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """Evaluation shard without padding, so summed metrics count every sample exactly once."""
    return list(range(rank, n, world_size))


def first_batch(dataset, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None = None):
    """One micro-batch, read without touching any random generator (for the memory estimate),
    collated as the loader does (the pipeline's collate_fn, else torch's default_collate, which
    keeps dicts and tuples); None for a stream, which has no batch to spare before its first epoch."""
    from torch.utils.data import default_collate

    from raylane.loop.protocols.batches import take_tallies

    if is_stream(dataset):
        return None
    batch = (collate_fn or default_collate)([dataset[i] for i in range(min(batch_size, len(dataset)))])
    take_tallies(batch)  # the loop's, not the model's inputs
    return batch


def fingerprint(data: Any) -> dict[str, Any] | None:
    """What the training data's epoch rests on, as cheap to find as the run's start already made
    it: a map-style dataset's `len` (its samples), a stream's rows per epoch (a file stream's
    per file or Parquet row group, from the footers or the counting pass it makes anyway: their
    total, their number and a digest of the list). Never a hash of the data itself, which would
    read terabytes at every start. None for data that knows none of these. Recorded in every
    checkpoint: a resume on other data is found by it (`data_change`)."""
    dataset = getattr(data, "dataset", None)  # a loader's, behind any wrapper of the loop's
    if dataset is not None:
        try:
            return {"samples": len(dataset)}
        except TypeError:  # an iterable dataset without a length
            return None
    rows = getattr(data, "rows", None)
    if isinstance(rows, int):  # a Ray Data stream's rows per epoch
        return {"samples": rows}
    if isinstance(rows, list) and all(isinstance(n, int) for n in rows):  # a file stream's, per piece
        digest = hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]
        return {"samples": sum(rows), "pieces": len(rows), "rows_digest": digest}
    return None


def data_change(
    saved: dict[str, Any] | None, now: dict[str, Any] | None, *, step: int, epoch: int, mid_epoch: bool
) -> str | None:
    """The line a resume says when the training data is not what the checkpoint of `step` was
    trained on (`saved`, its fingerprint; `now`, this run's), else None: the same, or unknown on
    either side (a checkpoint from before fingerprints). The rule it states: the epoch in
    progress (`epoch`, from 0) starts over from its first batch on the data as it is now, as a
    resume at another world size does; the weights, the optimizer, the schedule and the step go
    on. At an epoch end (`mid_epoch` False) the next epoch simply reads the new data."""
    if not saved or not now or saved == now:
        return None
    if saved.get("samples") != now.get("samples"):
        what = f"{_count(saved.get('samples'))} samples then, {_count(now.get('samples'))} now"
    elif saved.get("pieces") != now.get("pieces"):
        what = f"{saved.get('pieces')} files or row groups then, {now.get('pieces')} now"
    else:
        what = f"{_count(now.get('samples'))} samples then and now, in files of other lengths"
    where = f"the training data changed since the checkpoint of step {step} ({what})"
    if mid_epoch:
        return (
            f"{where}: epoch {epoch + 1} starts over on it from its first batch; the weights, optimizer and step go on"
        )
    return f"{where}: epoch {epoch + 1} reads it as it is now"


def _count(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"
