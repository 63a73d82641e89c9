"""The small interface between the training loop and whatever launched it.

`run_worker` and the Trainer only talk to a `Runtime`: where this rank sits, where checkpoints
live (its `store`, which also commits them), and where rank 0 publishes progress. `LocalRuntime`
serves a single process and torchrun; `raylane.onray.runtime.RayRuntime` serves Ray Train
workers. Nothing else in the loop knows which one it has."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from raylane.loop.checkpoint.storage import CheckpointStore
from raylane.loop.protocols.events import Event


class Runtime(Protocol):
    """What the loop knows of whatever launched it: where this rank sits (`rank`, `local_rank`,
    `world_size`, `device`, `node_ranks`), how the launcher restarts a group, where the run's
    checkpoints live (`store`), where rank 0 `publish`es progress, and the launcher's own
    readers of streaming data (`data_stream`). Like Lightning's ClusterEnvironment beside its
    CheckpointIO, it holds no checkpoint logic itself: the store does."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    # The launcher restarts the group without a node that gives notice it is leaving (an elastic
    # or fault-tolerant run on Ray): the loop then checkpoints and hands over instead of ending.
    restarts_without_leaving_nodes: bool

    # Read-only, so that a runtime may hold a narrower type (RayRuntime's store is a subclass).
    @property
    def node_ranks(self) -> list[int] | None:
        """Each rank's node, where the launcher knows it."""

    @property
    def store(self) -> CheckpointStore:
        """This run's checkpoints, as this rank sees them."""

    def publish(self, event: Event) -> None:
        """Rank 0 only, must not block: progress and results for the driver."""

    def data_stream(self, name: str, source: Any, *, batch_size: int) -> Any | None:
        """The launcher's own reader of a streaming source ("train" or "eval"; Ray Data's shard
        on Ray), or None: the loop reads the source itself (raylane.loop.data.streaming)."""


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

    def publish(self, event: Event) -> None:
        if self._publish is not None:
            self._publish(event)

    def data_stream(self, name: str, source: Any, *, batch_size: int) -> Any | None:
        return None
