"""A user's pipeline file (copied into a test's folder as pipe.py) whose loss function hangs on one
rank, as a real user's does on a lock, a read from a dead mount or a deadlock: a regression whose
rank `model.hang_rank` sleeps `model.hang_s` in its loss at step `model.hang_step`, after writing
the file `model.marker` (so a test knows it is there)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import raylane


class Model(raylane.Section):
    hang_rank: int = 1
    hang_step: int = 3
    hang_s: float = 0.0
    marker: str = ""


class Config(raylane.BaseConfig):
    model: Model = Model()


def build(cfg: Config) -> raylane.Pipeline:
    from torch.utils.data import TensorDataset

    hangs = int(os.environ.get("RANK", "0")) == cfg.model.hang_rank and cfg.model.hang_s > 0
    calls = [0]

    def loss(out, target):
        calls[0] += 1
        if hangs and calls[0] == cfg.model.hang_step:
            Path(cfg.model.marker).write_text(str(os.getpid()))
            time.sleep(cfg.model.hang_s)  # HANG: the line a hung rank's report names
        return torch.nn.functional.mse_loss(out, target)

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(512, 8, generator=g), torch.rand(512, 1, generator=g)
    return raylane.Pipeline(
        model=torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)),
        train_set=TensorDataset(x, y),
        loss_fn=loss,
        example_input=x[:2],
    )
