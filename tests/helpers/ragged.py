"""A user's pipeline (tests copy it into their tmp dir) whose items are sequences of random
length, padded into a batch by the pipeline's `collate_fn`, which returns an (input, target)
pair. Each item gets random noise when it is read (an augmentation: it draws from the generators
of the process that loads it). COLLATE_RAISES=N in the environment makes collate_fn raise from
its N-th call on (counted in each process: the 1st is the example batch read before training);
WORKER_MARKS=<folder> makes every loader worker leave a file named by its pid there."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

import raylane

LONGEST = 7


class Model(raylane.Section):
    width: int = 4


class Config(raylane.BaseConfig):
    model: Model = Model()


class Sequences(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = [torch.randn(int(torch.randint(1, LONGEST + 1, (1,), generator=g))) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        x = self.items[i]
        return x + 0.1 * torch.randn(len(x))  # the augmentation


CALLS = [0]


def pad(items: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    CALLS[0] += 1
    if CALLS[0] >= int(os.environ.get("COLLATE_RAISES") or 10**9):
        raise ValueError(f"a ragged batch of {len(items)} items")
    if (marks := os.environ.get("WORKER_MARKS")) and torch.utils.data.get_worker_info() is not None:
        (Path(marks) / str(os.getpid())).touch()
    longest = max(len(x) for x in items)
    inputs = torch.zeros(len(items), longest, 1)
    for row, x in enumerate(items):
        inputs[row, : len(x), 0] = x
    targets = torch.stack([x.mean() for x in items]).unsqueeze(1)
    return inputs, targets


class Net(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(1, width)
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inner(x)).mean(dim=1))


def build(cfg: Config) -> raylane.Pipeline:
    def loss_fn(output, target):
        return torch.nn.functional.mse_loss(output, target)

    def eval_sums(output, target):
        return {"loss": ((output - target) ** 2).sum()}

    return raylane.Pipeline(
        model=Net(cfg.model.width),
        train_set=Sequences(96, 1),
        eval_set=Sequences(16, 2),
        loss_fn=loss_fn,
        eval_sums=eval_sums,
        collate_fn=pad,
        example_input=torch.zeros(2, LONGEST, 1),
    )
