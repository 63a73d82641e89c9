#!/usr/bin/env python3
"""The hand-written DDP loop raylane is benchmarked against: the tutorial's multi-GPU script
(torchrun, `init_process_group`, DistributedSampler, DDP, a Trainer with `_run_batch` and
`_run_epoch`, a snapshot at the end), no Ray, no raylane runtime; with --ray, the same loop in a
plain Ray TorchTrainer. Only the model and the data
come from raylane's pipelines, so both sides train the same thing.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 scripts/ddp_baseline.py \\
        --pipeline digits --max-steps 300 --json out.json
    OMP_NUM_THREADS=1 python scripts/ddp_baseline.py --ray --pipeline digits --max-steps 300 --json out.json

Rank 0 writes {"train_s", "train_cpu_s", "steps", "first_step_unix", "last_step_unix", "startup"}
to --json: train_s runs from the start of training to the end of the loop, as raylane's summary
measures it; train_cpu_s is rank 0's process CPU time over the same span; startup, the unix time at
which each start-up phase ended (the names of raylane.loop.observe.startup.PHASES), for `raylane bench` B2b."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


class Trainer:
    def __init__(
        self,
        model,
        train_data,
        optimizer,
        loss_fn,
        max_steps: int,
        clip: float | None,
        snapshot_path: str,
        max_epochs: int | None = None,
        save_every_epoch: bool = False,
    ) -> None:
        self.rank = dist.get_rank()
        self.model = DDP(model)
        self.train_data, self.optimizer, self.loss_fn = train_data, optimizer, loss_fn
        self.max_steps, self.clip, self.snapshot_path = max_steps, clip, snapshot_path
        self.max_epochs, self.save_every_epoch = max_epochs, save_every_epoch
        self.step, self.first_step_unix, self.first_batch_unix = 0, None, None

    def _run_batch(self, source, targets) -> None:
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(source), targets)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            if self.first_batch_unix is None:
                self.first_batch_unix = time.time()
            self._run_batch(source, targets)
            self.step += 1
            if self.first_step_unix is None:
                self.first_step_unix = time.time()
            if self.step >= self.max_steps:
                return

    def _save_snapshot(self) -> None:
        torch.save({"model": self.model.module.state_dict(), "steps": self.step}, self.snapshot_path)

    def train(self) -> dict:
        started, started_cpu, epoch, epoch_ends = time.perf_counter(), time.process_time(), 0, []
        while self.step < self.max_steps and (self.max_epochs is None or epoch < self.max_epochs):
            self._run_epoch(epoch)
            epoch += 1
            if self.save_every_epoch and self.rank == 0:  # the tutorial's snapshot each epoch
                self._save_snapshot()
            epoch_ends.append(round(time.perf_counter() - started, 4))
        if self.rank == 0 and not self.save_every_epoch:
            self._save_snapshot()
        return {
            "train_s": time.perf_counter() - started,
            "train_cpu_s": time.process_time() - started_cpu,
            "steps": self.step,
            "first_step_unix": self.first_step_unix,
            "last_step_unix": time.time(),
            "epoch_end_s": epoch_ends,
        }


def build_optimizer(model, o) -> torch.optim.Optimizer:
    """The optimizer the config names, built by hand (raylane's own builder is not used here)."""
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    cls = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return cls(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


def run(
    pipeline: str,
    max_steps: int,
    overrides: list[str],
    json_path: str,
    max_epochs: int | None = None,
    save_every_epoch: bool = False,
    startup: dict[str, float] | None = None,
) -> None:
    """Train on the process group already set up (by torchrun or Ray Train); rank 0 writes --json."""
    from raylane.config import PIPELINES, load_config  # the same YAML and model as raylane, nothing else

    startup = dict(startup or {}, worker_imports=time.time())
    cfg = load_config(pipeline, overrides)
    torch.manual_seed(cfg.train.seed)
    pipe = importlib.import_module(PIPELINES[cfg.pipeline]).build(cfg)
    startup["pipeline"] = time.time()
    sampler = DistributedSampler(pipe.train_set, seed=cfg.train.seed)
    loader = DataLoader(pipe.train_set, batch_size=cfg.train.batch_size, sampler=sampler)
    optimizer = build_optimizer(pipe.model, cfg.optim)
    snapshot = os.path.join(os.path.dirname(os.path.abspath(json_path)), "baseline-snapshot.pt")
    trainer = Trainer(
        pipe.model,
        loader,
        optimizer,
        pipe.loss_fn,
        max_steps,
        cfg.train.grad_clip_norm,
        snapshot,
        max_epochs,
        save_every_epoch,
    )
    startup["parallelize"] = time.time()
    result = trainer.train()
    result["startup"] = {**startup, "first_batch": trainer.first_batch_unix, "first_step": trainer.first_step_unix}
    if dist.get_rank() == 0:
        with open(json_path, "w") as f:
            json.dump(result, f)


def _ray_loop(config: dict) -> None:
    from raylane.loop.observe.startup import process_start_unix

    run(
        config["pipeline"],
        config["max_steps"],
        config["overrides"],
        config["json"],
        startup={**config["startup"], "worker_process": process_start_unix()},
    )


def run_on_plain_ray(args: argparse.Namespace) -> None:
    """The same loop in a plain TorchTrainer with Ray Train's defaults (an embedded cluster, one
    CPU per worker): what raylane on Ray is compared with to tell Ray's cost from raylane's."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if args.address:
        ray.init(address=args.address, logging_level="WARNING")
    else:
        ray.init(address="local", num_cpus=max(args.workers, os.cpu_count() or 1), logging_level="WARNING")
    startup = {**args.startup, "ray_init": time.time()}
    trainer = TorchTrainer(
        _ray_loop,
        train_loop_config={
            "pipeline": args.pipeline,
            "max_steps": args.max_steps,
            "startup": startup,
            "overrides": args.overrides,
            "json": os.path.abspath(args.json),
        },
        scaling_config=ScalingConfig(num_workers=args.workers),
        run_config=RunConfig(storage_path=os.path.join(os.path.dirname(os.path.abspath(args.json)), "plain-ray")),
    )
    startup["fit"] = time.time()  # read by the workers after this: the train loop config is a live dict
    trainer.fit()
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipeline", required=True)
    parser.add_argument("--max-steps", type=int, default=10**12)
    parser.add_argument("--max-epochs", type=int, help="stop after this many epochs too")
    parser.add_argument(
        "--save-every-epoch",
        action="store_true",
        help="rank 0 saves a snapshot at each epoch end (the tutorial's save_every=1)",
    )
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--json", required=True)
    parser.add_argument("--ray", action="store_true", help="run in a plain Ray TorchTrainer, not under torchrun")
    parser.add_argument("--workers", type=int, default=2, help="with --ray: the number of workers")
    parser.add_argument("--address", help="with --ray: a running cluster to join (default: start one)")
    args = parser.parse_args()
    from raylane.loop.observe.startup import process_start_unix

    args.startup = {"launch": process_start_unix(), "driver_imports": time.time()}
    if args.ray:
        run_on_plain_ray(args)
        return
    dist.init_process_group("gloo")
    run(args.pipeline, args.max_steps, args.overrides, args.json, args.max_epochs, args.save_every_epoch)
    dist.destroy_process_group()
    # Exit without the interpreter's teardown, as `raylane` does: gloo's threads were seen to
    # abort a finished rank there ("terminate called without an active exception"), which
    # failed the whole benchmark after the figures were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
