"""A pipeline for replica-group tests (tests/e2e/test_ft_loop.py): a small MLP regression on fixed
data, with a hook that records, after every step, the step, the time, the training samples this
rank read for it (their indices) and a digest of its parameters and optimizer state (the local
shards under FSDP) as one JSON line in the file $FT_RECORD; with $FT_PARAMS, its parameters
after each step in the file $FT_PARAMS<step>.pt (torch.save); with $FT_GATE (STEP:PATH), it
waits after step STEP until the file PATH exists (a test's gate)."""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch
from torch.utils.data import Dataset, TensorDataset

import raylane

READ: list[int] = []  # the training samples read since the last step's end, in order


class Indexed(Dataset):
    """The training set, noting each sample read (the loader reads in the rank's own process)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        READ.append(int(i))
        return self.x[i], self.y[i]


class Model(raylane.Section):
    rows: int = 2048
    width: int = 16


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self):
        return ("loss",)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """This rank's parameters and optimizer state, bit for bit."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(_local(p).detach().cpu().contiguous().numpy().tobytes())
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if torch.is_tensor(value):
                h.update(key.encode())
                h.update(_local(value).detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Record(raylane.Hook):
    def __init__(self) -> None:
        self.path = os.environ.get("FT_RECORD")
        self.params = os.environ.get("FT_PARAMS")  # a prefix: the parameters after each step, as torch.save
        self.gate = os.environ.get("FT_GATE")  # STEP:PATH, after step STEP wait (up to 5 min) for PATH

    def on_step_end(self, ctx: raylane.HookContext) -> None:
        if self.params:
            params = {name: _local(p).detach().clone() for name, p in ctx.model.named_parameters()}
            torch.save(params, f"{self.params}{ctx.step}.pt")
        if self.gate and ctx.step == int(self.gate.split(":")[0]):
            deadline = time.monotonic() + 300
            while not os.path.exists(self.gate.split(":", 1)[1]) and time.monotonic() < deadline:
                time.sleep(0.05)
        if self.path:
            with open(self.path, "a") as f:
                line = {"step": ctx.step, "epoch": ctx.epoch, "t": time.time(), "pid": os.getpid(), "read": READ[:]}
                f.write(json.dumps({**line, "digest": digest(ctx.model, ctx.optimizer)}) + "\n")
        READ.clear()


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Net(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width), Block(width)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(cfg: Config):
    m = cfg.model
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m.rows + 256, m.width, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(m.rows + 256, 1, generator=gen)
    return raylane.Pipeline(
        model=Net(m.width),
        train_set=Indexed(x[: m.rows], y[: m.rows]),
        eval_set=TensorDataset(x[m.rows :], y[m.rows :]),
        loss_fn=torch.nn.functional.mse_loss,
        eval_sums=lambda out, target: {"loss": torch.nn.functional.mse_loss(out, target, reduction="sum")},
        hooks=[Record()],
    )
