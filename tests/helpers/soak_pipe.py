"""A tiny pipeline for the many-node soak (tests/e2e/test_many_nodes.py): a small MLP regression
whose every rank appends, after each step, one JSON line {step, pid, node, t} to
`$SOAK_RECORD/rank<R>.jsonl`, so that a test knows each rank's process (and so the fake node
whose raylet started it) and how far the run has got, without reading raylane's own records."""

from __future__ import annotations

import json
import os
import time

import torch
from torch.utils.data import TensorDataset

import raylane


class Model(raylane.Section):
    rows: int = 4096
    width: int = 16


class Config(raylane.BaseConfig):
    model: Model = Model()


class Record(raylane.Hook):
    def __init__(self) -> None:
        self.folder = os.environ.get("SOAK_RECORD")

    def on_step_end(self, ctx: raylane.HookContext) -> None:
        if self.folder:
            line = {"step": ctx.step, "pid": os.getpid(), "node": os.environ.get("RAYLANE_NODE_NAME"), "t": time.time()}
            with open(os.path.join(self.folder, f"rank{ctx.rank}.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")


def build(cfg: Config) -> raylane.Pipeline:
    m = cfg.model
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m.rows, m.width, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    model = torch.nn.Sequential(torch.nn.Linear(m.width, m.width), torch.nn.Tanh(), torch.nn.Linear(m.width, 1))
    return raylane.Pipeline(
        model=model,
        train_set=TensorDataset(x, y),
        loss_fn=torch.nn.functional.mse_loss,
        example_input=x[:2],
        hooks=[Record()],
    )
