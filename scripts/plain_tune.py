#!/usr/bin/env python3
"""The plain Ray Tune side of benchmark B4: the same sweep (`digits`, 2 workers per trial, a grid
of learning rates, N trials at a time) as Ray's documentation writes it: a function trainable
that builds its own TorchTrainer, whose workers run the hand-written DDP loop
(scripts/ddp_baseline.py) and report each epoch. No raylane: no MLflow, no checkpoints.

    python scripts/plain_tune.py --lrs 0.001,0.002 --epochs 2 --concurrency 2 --json out.json"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TRIAL_DRIVER_CPU = 0.01


def train_loop(config: dict) -> None:
    import importlib

    import ray.train
    import torch
    from ddp_baseline import Trainer
    from torch.utils.data import DataLoader, DistributedSampler

    from raylane.config import PIPELINES, load_config

    cfg = load_config("digits", [f"optim.lr={config['lr']}"])
    torch.manual_seed(cfg.train.seed)
    pipe = importlib.import_module(PIPELINES[cfg.pipeline]).build(cfg)
    loader = DataLoader(
        pipe.train_set, batch_size=cfg.train.batch_size, sampler=DistributedSampler(pipe.train_set, seed=cfg.train.seed)
    )
    optimizer = torch.optim.Adam(pipe.model.parameters(), lr=cfg.optim.lr)
    with tempfile.TemporaryDirectory() as d:
        trainer = Trainer(
            pipe.model, loader, optimizer, pipe.loss_fn, max_steps=10**9, clip=None, snapshot_path=f"{d}/snapshot.pt"
        )
        for epoch in range(config["epochs"]):
            trainer._run_epoch(epoch)
            ray.train.report({"epoch": epoch + 1})


def trial(config: dict) -> None:
    from ray import tune
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    started = time.monotonic()
    TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=config["workers"], resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=config["storage"], name=f"trial-{tune.get_context().get_trial_id()}"),
    ).fit()
    tune.report({"trial_s": time.monotonic() - started})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lrs", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()

    import ray
    from ray import tune

    storage = tempfile.mkdtemp(prefix="plain-tune-")
    per_trial = args.workers + TRIAL_DRIVER_CPU
    ray.init(
        address="local",
        num_cpus=math.ceil(per_trial * args.concurrency),
        include_dashboard=False,
        logging_level="WARNING",
    )
    space = {
        "lr": tune.grid_search([float(x) for x in args.lrs.split(",")]),
        "epochs": args.epochs,
        "workers": args.workers,
        "storage": storage,
    }
    tuner = tune.Tuner(
        tune.with_resources(trial, {"CPU": TRIAL_DRIVER_CPU}),
        param_space=space,
        tune_config=tune.TuneConfig(max_concurrent_trials=args.concurrency),
        run_config=tune.RunConfig(storage_path=storage, name="plain"),
    )
    started = time.monotonic()
    grid = tuner.fit()
    wall_s = time.monotonic() - started
    trial_s = [r.metrics["trial_s"] for r in grid]
    ray.shutdown()
    Path(args.json).write_text(
        json.dumps(
            {
                "wall_s": wall_s,
                "trial_s_sum": sum(trial_s),
                "ideal_s": sum(trial_s) / args.concurrency,
                "errors": len(grid.errors),
            }
        )
    )


if __name__ == "__main__":
    main()
