"""A user's pipeline (tests copy it into their tmp dir as pipe.py) that writes down, on each rank
as it builds, where it runs and what of `model.watch`'s variables it sees: the Ray node's id, and
for each variable a sha256 of its value (a secret is never written, so a search for it in the
test's folder finds only what raylane wrote). A linear regression on fixed data."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import raylane


class Model(raylane.Section):
    record: str = "seen"
    watch: tuple[str, ...] = ()


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self):
        return ("loss",)


def fingerprint(value: str | None) -> str | None:
    return None if value is None else hashlib.sha256(value.encode()).hexdigest()


def build(cfg: Config) -> raylane.Pipeline:
    import ray
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    seen = {
        "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
        "env": {name: fingerprint(os.environ.get(name)) for name in cfg.model.watch},
    }
    folder = Path(cfg.model.record)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank-{rank}.json").write_text(json.dumps(seen))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 4, generator=gen), torch.rand(64, 1, generator=gen)
    return raylane.Pipeline(
        model=torch.nn.Linear(4, 1),
        train_set=TensorDataset(x[:48], y[:48]),
        eval_set=TensorDataset(x[48:], y[48:]),
        loss_fn=torch.nn.functional.mse_loss,
        eval_sums=lambda out, target: {"loss": torch.nn.functional.mse_loss(out, target, reduction="sum")},
    )
