"""One worker group's Ray Train run as the driver follows it: its name, storage and size
(`Group`), its fit() on a thread of its own (`Fit`) and the event sink its rank 0 sends to
(`event_sink`). A run has one (raylane.onray.launch); a fault-tolerant run one per replica group
(raylane.onray.replicas)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import ray
from ray.train.torch import TorchTrainer

from raylane.errors import TrainingError
from raylane.loop.protocols.events import Event
from raylane.onray.failures import bad_input, format_failure
from raylane.onray.runtime import EventSink

log = logging.getLogger("raylane")


def event_sink(name: str | None = None) -> Any:
    """The driver's event sink, on the driver's own node: anywhere else, losing that node (a spot
    reclaim that an elastic run should survive) would end the run with it. `name`: what another
    process finds it by (a sweep's driver asks a trial's ranks to stop through it); a name still
    held (a restarted trial's earlier sink, not yet gone) leaves it unnamed."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    placed = {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=True)}
    make = EventSink.options  # type: ignore[attr-defined]
    if name:
        try:
            return make(name=name, **placed).remote()
        except ValueError:
            log.debug("event sink %s: the name is taken; unnamed", name)
    return make(**placed).remote()


class Fit:
    """A worker group's TorchTrainer.fit() on a thread of its own (`start`), and the event sink
    its rank 0 sends to. On a helper thread so that the driver's main thread keeps Ctrl-C and
    SIGTERM (Ray installs its own SIGINT handler only from the main thread); there, the sink's
    events are relayed (`pump`)."""

    def __init__(self, trainer: TorchTrainer, sink: Any, world_size: int) -> None:
        self.sink = sink
        self.world_size = world_size  # the group's, as its ranks are numbered
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._fit, args=(trainer,), name="raylane-fit", daemon=True)

    def _fit(self, trainer: TorchTrainer) -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # noqa: BLE001 - raised again on the main thread (failure)
            self.error = exc

    def start(self) -> threading.Thread:
        self.thread.start()
        return self.thread

    def drain(self) -> list[Event]:
        return ray.get(self.sink.drain.remote())

    def request_stop(self) -> None:
        self.sink.request_stop.remote()

    def failure(self) -> BaseException | None:
        """How fit() ended, as the driver raises it: None when it returned; a failed worker group
        as one line (TrainingError), each rank's exception, or as the ConfigError its ranks raised
        (bad input: exit 2)."""
        if isinstance(self.error, ray.train.TrainingFailedError):
            line = format_failure(self.error, self.world_size)  # the ranks' tracebacks into the library log
            return bad_input(self.error) or TrainingError(line)
        return self.error


@dataclasses.dataclass(frozen=True)
class Group:
    """A worker group's own Ray Train run: its name and storage path (Ray's RunConfig), its size
    (ScalingConfig's num_workers: (min, max) for an elastic run) and, for one of a run's replica
    groups (raylane.onray.replicas), its index."""

    name: str | None
    storage_path: str
    num_workers: int | tuple[int, int]
    replica_group: int | None = None
