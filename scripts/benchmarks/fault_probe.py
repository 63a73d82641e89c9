"""A pipeline that tells, per replica group and rank, what each step did: a small MLP on fixed data
whose hook appends one JSON line per step to `<model.record>/g<group>-r<rank>.jsonl` (the time,
the process, the step; `-` for the group of a run without replica groups). B14 reads when each
worker stopped and came back around a killed worker (scripts/benchmarks/faults.py)."""

import json
import os
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import raylane


class Model(raylane.Section):
    record: str = "seen"
    samples: int = 64


class Config(raylane.BaseConfig):
    model: Model = Model()


class Probe(raylane.Hook):
    def __init__(self, folder):
        self.folder = Path(folder)

    def setup(self, ctx):
        self.folder.mkdir(parents=True, exist_ok=True)

    def on_step_end(self, ctx):
        group = os.environ.get("RAYLANE_REPLICA_GROUP", "-")
        record = {"time": time.time(), "pid": os.getpid(), "step": ctx.step}
        with open(self.folder / f"g{group}-r{ctx.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def build(cfg):
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(cfg.model.samples, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    return raylane.Pipeline(
        model=torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)),
        train_set=TensorDataset(x, y),
        loss_fn=torch.nn.functional.mse_loss,
        hooks=[Probe(cfg.model.record)],
    )
