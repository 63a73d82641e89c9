"""The small interface between the training loop and whatever launched it.

`run_worker` and the Trainer only talk to a `Runtime`: where this rank sits, where checkpoints
go and how they are committed, and where rank 0 publishes progress. `LocalRuntime` serves a single
process and torchrun; `raylane.onray.launch.RayRuntime` serves Ray Train workers. Nothing else in the loop
knows which one it has."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from raylane.loop.checkpoint.storage import CheckpointStore
from raylane.loop.events import Event


class Runtime(Protocol):
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    node_ranks: list[int] | None  # each rank's node, where the launcher knows it
    # The launcher restarts the group without a node that gives notice it is leaving (an elastic
    # or fault-tolerant run on Ray): the loop then checkpoints and hands over instead of ending.
    restarts_without_leaving_nodes: bool

    def latest_checkpoint(self) -> str | None:
        """Directory of the newest committed checkpoint of this run, or None."""

    def skipped_checkpoints(self) -> list[dict[str, str]]:
        """The newer checkpoints latest_checkpoint() passed over (damaged, unfinished), newest
        first: {"path", "reason"}."""

    def new_checkpoint_dir(self, step: int) -> str:
        """Where this rank writes its shard of the checkpoint at `step`."""

    def commit_checkpoint(
        self,
        path: str,
        step: int,
        metrics: dict[str, float],
        *,
        keep: int | None,
        keep_best: int | None,
        best: tuple[str, str],
    ) -> str:
        """Collective, after the manifest is written: make it durable in storage, register it,
        prune (`checkpoint.prune`); returns its location. Raises CheckpointSaveError on every
        rank if storage refused it."""

    def discard_checkpoint(self, path: str) -> None:
        """Collective: remove what a failed save left behind (it was never committed)."""

    def publish(self, event: Event) -> None:
        """Rank 0 only, must not block: progress and results for the driver."""

    def data_stream(self, name: str, source: Any, *, batch_size: int) -> Any | None:
        """The launcher's own reader of a streaming source ("train" or "eval"; Ray Data's shard
        on Ray), or None: the loop reads the source itself (raylane.loop.streaming)."""


class LocalRuntime:
    """A single process, or one rank under torchrun: checkpoints go straight to storage (a local
    or shared directory, or object storage; see raylane.loop.checkpoint.storage)."""

    def __init__(
        self,
        store: CheckpointStore,
        rank: int,
        local_rank: int,
        world_size: int,
        device: torch.device,
        publish: Callable[[Event], None] | None = None,
    ) -> None:
        self.store = store
        self.rank, self.local_rank, self.world_size, self.device = rank, local_rank, world_size, device
        self.node_ranks = None
        self.restarts_without_leaving_nodes = False  # torchrun's agent restarts whole groups only
        self._publish = publish

    def latest_checkpoint(self) -> str | None:
        return self.store.latest()

    def skipped_checkpoints(self) -> list[dict[str, str]]:
        return self.store.skipped

    def new_checkpoint_dir(self, step: int) -> str:
        return self.store.new_dir(step)

    def commit_checkpoint(
        self,
        path: str,
        step: int,
        metrics: dict[str, float],
        *,
        keep: int | None,
        keep_best: int | None,
        best: tuple[str, str],
    ) -> str:
        return self.store.commit(path, step, keep=keep, keep_best=keep_best, best=best)

    def discard_checkpoint(self, path: str) -> None:
        self.store.discard(path)

    def publish(self, event: Event) -> None:
        if self._publish is not None:
            self._publish(event)

    def data_stream(self, name: str, source: Any, *, batch_size: int) -> Any | None:
        return None
