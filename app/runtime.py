"""The small interface between the training loop and whatever launched it.

`run_worker` and the Trainer only talk to a `Runtime`: where this rank sits, where checkpoints
go and how they are committed, and where rank 0 publishes progress. `LocalRuntime` serves a single
process and torchrun; `app.launch.RayRuntime` serves Ray Train workers. Nothing else in the loop
knows which one it has."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from app import checkpoint
from app.distributed import barrier


class Runtime(Protocol):
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    def latest_checkpoint(self) -> str | None:
        """Directory of the newest committed checkpoint of this run, or None."""

    def new_checkpoint_dir(self, step: int) -> str:
        """Where this rank writes its shard of the checkpoint at `step`."""

    def commit_checkpoint(self, path: str, step: int, metrics: dict[str, float], *, keep: int | None,
                          keep_best: int | None, best: tuple[str, str]) -> str:
        """Collective, after every rank has saved: register it, then prune (`checkpoint.prune`);
        returns its persistent location."""

    def discard_checkpoint(self, path: str) -> None:
        """Collective: remove what a failed save left behind (it was never committed)."""

    def publish(self, event: dict[str, Any]) -> None:
        """Rank 0 only, must not block: progress and results for the driver."""


class LocalRuntime:
    """A single process, or one rank under torchrun: checkpoints go straight to storage."""

    def __init__(self, run_dir: str | Path, rank: int, local_rank: int, world_size: int,
                 device: torch.device, publish: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.rank, self.local_rank, self.world_size, self.device = rank, local_rank, world_size, device
        self._publish = publish

    def latest_checkpoint(self) -> str | None:
        return checkpoint.latest_valid(str(self.run_dir))

    def new_checkpoint_dir(self, step: int) -> str:
        path = self.run_dir / checkpoint.checkpoint_name(step)
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def commit_checkpoint(self, path: str, step: int, metrics: dict[str, float], *, keep: int | None,
                          keep_best: int | None, best: tuple[str, str]) -> str:
        barrier()  # rank 0's manifest is the commit; no rank goes on before it exists
        if self.rank == 0:
            checkpoint.prune(str(self.run_dir), keep, keep_best=keep_best, best=best)
        return path

    def discard_checkpoint(self, path: str) -> None:
        # Every rank has finished writing (the failed commit gathered from all of them).
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    def publish(self, event: dict[str, Any]) -> None:
        if self._publish is not None:
            self._publish(event)
