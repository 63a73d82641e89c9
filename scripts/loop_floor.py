#!/usr/bin/env python3
"""The tutorial's single-process loop (no process group, no DDP): the floor `raylane train --local`
is measured against to price raylane's own per-step work without two ranks' scheduling noise.

    OMP_NUM_THREADS=1 python scripts/loop_floor.py regression 4000
    OMP_NUM_THREADS=1 raylane train regression --local --set scaling.num_workers=1 \\
        --set train.max_steps=4000 --set mlflow.enabled=false --summary-json s.json

Both print (or write) train_s and train_cpu_s; the per-step cost is the slope between two run
lengths (500 and 4000 steps), as in bench B1."""

from __future__ import annotations

import importlib
import json
import sys
import time

import torch
from ddp_baseline import build_optimizer  # scripts/ is on sys.path when run as a script
from torch.utils.data import DataLoader, DistributedSampler

from raylane.config import PIPELINES, load_config


def main(pipeline: str, max_steps: int) -> None:
    cfg = load_config(pipeline)
    torch.manual_seed(cfg.train.seed)
    pipe = importlib.import_module(PIPELINES[cfg.pipeline]).build(cfg)
    # raylane samples through a DistributedSampler on one rank too: the same order, the same cost.
    loader = DataLoader(
        pipe.train_set,
        batch_size=cfg.train.batch_size,
        sampler=DistributedSampler(pipe.train_set, num_replicas=1, rank=0, seed=cfg.train.seed),
    )
    optimizer = build_optimizer(pipe.model, cfg.optim)
    steps, epoch = 0, 0
    started, started_cpu = time.perf_counter(), time.process_time()
    while steps < max_steps:
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            optimizer.zero_grad()
            pipe.loss_fn(pipe.model(source), targets).backward()
            optimizer.step()
            steps += 1
            if steps >= max_steps:
                break
        epoch += 1
    print(
        json.dumps(
            {"train_s": time.perf_counter() - started, "train_cpu_s": time.process_time() - started_cpu, "steps": steps}
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
