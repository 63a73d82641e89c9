"""Data loading: a DistributedSampler for every world size (1 included), so the order of samples
depends only on the seed, the epoch and the world size, and a resumed epoch can skip exactly the
batches it already ran."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


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


def build_loader(
    dataset: Dataset, *, batch_size: int, rank: int, world_size: int, seed: int, shuffle: bool
) -> DataLoader:
    sampler = ResumableSampler(
        dataset, batch_size=batch_size, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, **loader_options(seed))


def loader_options(seed: int) -> dict:
    # In-memory tensors: worker processes would only add start-up time and nondeterminism. Every
    # iter() of a DataLoader draws a seed from its generator: a private one keeps the global RNG
    # (dropout) on the same sequence whether or not an epoch was resumed part-way.
    return {"num_workers": 0, "generator": torch.Generator().manual_seed(seed)}


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """Evaluation shard without padding, so summed metrics count every sample exactly once."""
    return list(range(rank, n, world_size))
