"""Data loading: a DistributedSampler for every world size (1 included), so the order of samples
depends only on the seed, the epoch and the world size, and a resumed epoch can skip exactly the
batches it already ran. With train.global_batch, a `GlobalOrderSampler` instead: the order
depends on the seed and the epoch alone, and a resume on another world size continues the
epoch at the same sample.

The Trainer iterates any `EpochData`: this module's `EpochLoader` for map-style datasets, or a
stream of a `raylane.loop.streaming.FileSource` (pyarrow's `FileStream`, or the launcher's own,
Ray Data's shard on Ray)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset


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

    def __init__(self, n: int, *, samples_per_step: int, batch_size: int, rank: int, world_size: int,
                 seed: int) -> None:
        self.n, self.samples_per_step, self.batch_size = n, samples_per_step, batch_size
        self.per_rank = samples_per_step // world_size
        self.rank, self.seed = rank, seed
        self.steps = n // samples_per_step
        if self.steps == 0:
            raise ValueError(f"train.global_batch = {samples_per_step}: more than the {n} training samples; "
                             "an epoch would have no step")
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
    datasets. Iterating it is plain DataLoader iteration (the per-step hot path is unchanged)."""

    epochs_alike = True

    def batches_in_epoch(self, epoch: int) -> int:
        return math.ceil(self.sampler.num_samples / self.batch_size)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.sampler.set_epoch(epoch, skip_batches=skip_batches)


def build_loader(
    dataset: Dataset, *, batch_size: int, rank: int, world_size: int, seed: int, shuffle: bool,
    samples_per_step: int | None = None,
) -> EpochLoader:
    sampler: Sampler[int]
    if samples_per_step:
        sampler = GlobalOrderSampler(len(dataset), samples_per_step=samples_per_step, batch_size=batch_size,
                                     rank=rank, world_size=world_size, seed=seed)
    else:
        sampler = ResumableSampler(
            dataset, batch_size=batch_size, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed
        )
    return EpochLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_options(seed))


def is_stream(data: Any) -> bool:
    from raylane.loop.streaming import FileSource

    return isinstance(data, FileSource)


def train_data(dataset: Any, runtime: Any, *, batch_size: int, seed: int,
               samples_per_step: int | None = None) -> EpochData:
    """The training batches of this rank: a map-style dataset's loader, or a FileSource's stream
    (the launcher's, when it made one: Ray Data on Ray; else read here with pyarrow). With
    `samples_per_step` (train.global_batch), the epoch's order is the same at any world size."""
    if not is_stream(dataset):
        return build_loader(dataset, batch_size=batch_size, rank=runtime.rank, world_size=runtime.world_size,
                            seed=seed, shuffle=True, samples_per_step=samples_per_step)
    if samples_per_step:
        raise ValueError("train.global_batch: a streaming source's epochs are shared out by file, not by sample; "
                         "leave train.global_batch unset for it")
    from raylane.loop.streaming import FileStream

    return runtime.data_stream("train", dataset, batch_size=batch_size) or FileStream(
        dataset, batch_size=batch_size, rank=runtime.rank, world_size=runtime.world_size, seed=seed)


def eval_data(dataset: Any, runtime: Any, *, batch_size: int, seed: int, stream: str = "eval") -> Any:
    """This rank's share of the held-out set, every sample in exactly one rank's share; for
    named sets ({name: dataset}), {name: its share}. `stream`: the launcher's name for a
    streaming set (named sets: "eval.<name>", see raylane.onray.datasets)."""
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        return {name: eval_data(data, runtime, batch_size=batch_size, seed=seed, stream=f"eval.{name}")
                for name, data in dataset.items()}
    if is_stream(dataset):
        from raylane.loop.streaming import FileEvalStream

        return runtime.data_stream(stream, dataset, batch_size=batch_size) or FileEvalStream(
            dataset, batch_size=batch_size, rank=runtime.rank, world_size=runtime.world_size)
    shard = Subset(dataset, shard_indices(len(dataset), runtime.rank, runtime.world_size))
    return DataLoader(shard, batch_size=batch_size, **loader_options(seed))


def loader_options(seed: int) -> dict:
    # In-memory tensors: worker processes would only add start-up time and nondeterminism. Every
    # iter() of a DataLoader draws a seed from its generator: a private one keeps the global RNG
    # (dropout) on the same sequence whether or not an epoch was resumed part-way.
    return {"num_workers": 0, "generator": torch.Generator().manual_seed(seed)}


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """Evaluation shard without padding, so summed metrics count every sample exactly once."""
    return list(range(rank, n, world_size))
