"""What a training run pays besides its steps, measured for one `raylane autotune` candidate: the
evaluation and the checkpoint save of its epoch ends, as seconds to spread over the steps between
them. Collective (every rank calls it), Ray-free.

On a small model these are a large share: examples/own-model (25 steps an epoch) trained 20-25%
slower, samples over seconds of a 30-epoch run, with its default evaluation and checkpoint each
epoch than its steps alone ran (2 busy CPU cores)."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from raylane.config import BaseConfig
from raylane.loop import checkpoint
from raylane.loop.data.loader import eval_data, is_stream, worker_options
from raylane.loop.evaluation import Evaluator

# Held-out batches timed (after one untimed) to estimate an evaluation of the whole share.
EVAL_BATCHES = 4


def per_step_seconds(cfg: BaseConfig, steps_per_epoch: int, eval_s: float, save_s: float) -> float:
    """Epoch-end work spread over training's steps, at the config's frequencies."""
    t, ck = cfg.train, cfg.checkpoint
    out = eval_s / (steps_per_epoch * t.eval_every_n_epochs) if t.eval_every_n_epochs else 0.0
    if t.eval_every_n_steps:
        out += eval_s / t.eval_every_n_steps
    if ck.every_n_epochs:
        out += save_s / (steps_per_epoch * ck.every_n_epochs)
    if ck.every_n_steps:
        out += save_s / ck.every_n_steps
    return out


def eval_seconds(cfg: BaseConfig, model: torch.nn.Module, pipe: Any, runtime: Any, clock: Callable[[], float]) -> float:
    """One evaluation of rank 0's share of the held-out set, as the Trainer runs it (the
    Evaluator, with the pipeline's eval_sums): EVAL_BATCHES batches timed after one untimed,
    scaled to the share. 0 without evaluation or a held-out set, and for a stream, whose share
    is not known ahead."""
    dataset, world, size = pipe.eval_set, runtime.world_size, cfg.train.batch_size
    if isinstance(dataset, dict):  # named held-out sets, evaluated in turn
        return sum(eval_seconds(cfg, model, replace(pipe, eval_set=data), runtime, clock) for data in dataset.values())
    if not (cfg.train.eval_every_n_epochs or cfg.train.eval_every_n_steps) or dataset is None or is_stream(dataset):
        return 0.0
    timed = min(EVAL_BATCHES, len(dataset) // world // size - 1)  # every rank has these in full
    if timed < 1:
        return 0.0
    loader = eval_data(
        dataset,
        runtime,
        batch_size=size,
        seed=cfg.train.seed,
        collate_fn=pipe.collate_fn,
        options=worker_options(cfg.loader, runtime.device),
    )
    batches = list(itertools.islice(loader, timed + 1))

    def evaluator(data: list[Any]) -> Evaluator:
        return Evaluator(
            data, pipe.eval_sums, runtime.device, world, loss_fn=pipe.loss_fn, step=pipe.step, count=pipe.eval_count
        )

    evaluator(batches[:1])(model)  # compiles, agrees on names
    began = clock()
    evaluator(batches[1:])(model)
    elapsed = clock() - began
    model.train()
    return elapsed / timed * len(loader)


def save_seconds(
    cfg: BaseConfig,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    rank: int,
    clock: Callable[[], float],
    group: Any = None,
) -> float:
    """One synchronous save and commit of the candidate's state into a scratch folder on this
    machine, removed after. An asynchronous save (the default) does the same work on another
    thread: on busy cores it slows the steps about as much; with cores to spare, less. A save to
    remote storage (s3://) takes longer than this one. 0 when the config saves no checkpoints."""
    if not (cfg.checkpoint.every_n_epochs or cfg.checkpoint.every_n_steps):
        return 0.0
    folder = [tempfile.mkdtemp(prefix="raylane-autotune-") if rank == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(folder, src=0, group=group)  # the same path on every rank
    path = f"{folder[0]}/checkpoint"
    began = clock()
    try:
        checkpoint.save(path, model, optimizer, train_state, rank=rank)
    except checkpoint.CheckpointSaveError:  # another node's shard is not in this node's folder
        pass
    elapsed = clock() - began
    shutil.rmtree(folder[0], ignore_errors=True)
    return elapsed
