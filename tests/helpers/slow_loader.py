"""A user's pipeline file (copied into a test's folder as pipe.py) whose data loader is slow on one
rank, as a real user's is on a node with a slow disk or a busy CPU: a regression whose batches on
rank `model.slow_rank` take `model.sleep_s` more to load (its collate_fn sleeps). A calm run
(`model.sleep_s: 0`) loads at the same speed everywhere. `model.probe`: see Probe."""

from __future__ import annotations

import os
import time

import torch

import raylane


class Model(raylane.Section):
    slow_rank: int = 1
    sleep_s: float = 0.0
    probe: str = ""


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self):
        return ("loss",)


def build(cfg: Config) -> raylane.Pipeline:
    from torch.utils.data import TensorDataset, default_collate

    slow = int(os.environ.get("RANK", "0")) == cfg.model.slow_rank and cfg.model.sleep_s > 0
    pause = cfg.model.sleep_s

    def collate(rows):
        if slow:
            time.sleep(pause)  # this rank's loader: a slow disk, say
        return default_collate(rows)

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(640, 8, generator=g), torch.rand(640, 1, generator=g)
    return raylane.Pipeline(
        model=torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)),
        train_set=TensorDataset(x[:512], y[:512]),
        eval_set=TensorDataset(x[512:], y[512:]),
        loss_fn=torch.nn.functional.mse_loss,
        eval_sums=lambda out, target: {"loss": torch.nn.functional.mse_loss(out, target, reduction="sum")},
        collate_fn=collate,
        example_input=x[:2],
        hooks=[Probe(cfg.model.probe)] if cfg.model.probe else [],
    )


class Probe(raylane.Hook):
    """Writes, at the run's last step, whether this rank's profiler was ever on during a step and
    whether raylane's profiling module was imported in this process (`model.probe`: a folder)."""

    def __init__(self, folder: str) -> None:
        self.folder, self.profiled_steps = folder, []

    def on_step_end(self, ctx) -> None:
        if torch._C._autograd._profiler_enabled():
            self.profiled_steps.append(ctx.step)
        import json
        import sys

        state = {"profiled_steps": self.profiled_steps, "imported": "raylane.loop.observe.profiling" in sys.modules}
        with open(os.path.join(self.folder, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(state, f)
