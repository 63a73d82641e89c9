"""What a Ray Train worker's loop sees of Ray (`RayRuntime`, raylane.loop.protocols.runtime's protocol) and the
small actor through which rank 0's events reach the driver (`EventSink`); raylane's warnings on a
worker are relayed through it too (`relay_warnings`)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any

import ray
import ray.train
import torch

from raylane.loop import preemption
from raylane.loop.distributed.groups import node_layout
from raylane.loop.observe.startup import process_start_unix
from raylane.loop.protocols.events import End, Event, Handover, Log, SearchEnd, Startup
from raylane.onray.leftovers import DriverWatch, ProcessId
from raylane.onray.store import DriverWatchedStore

log = logging.getLogger("raylane")

DRIVER_STOP_POLL_S = 0.5
DRAIN_POLL_S = 0.5  # Ray Train polls node drains every 5 s itself


@ray.remote(num_cpus=0)
class EventSink:
    """Holds rank 0's events until the driver drains them, and the driver's stop request."""

    def __init__(self) -> None:
        # When this actor's process started: before the run, it was a warm worker (raylane.onray.warm).
        started = process_start_unix()
        self.events: list[Event] = [Startup(phases={}, processes={"event sink": started})] if started else []
        self.stop = False
        self.handover: str | None = None  # a larger group fits: None, "requested", then "done"
        self.ended = False  # rank 0's End has come (its MLflow metrics were all sent before it)

    def put(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, Handover) and self.handover == "requested":
            self.handover = "done"
        self.ended = self.ended or isinstance(event, End)

    def has_ended(self) -> bool:
        """Rank 0 has ended the run (whether or not the driver has drained its End yet)."""
        return self.ended

    def request_stop(self) -> None:
        self.stop = True

    def stop_requested(self) -> bool:
        return self.stop

    def request_handover(self) -> None:
        self.handover = "requested"

    def clear_handover(self) -> None:
        """The policy has resized, gave up waiting, or the group restarted: nothing is asked."""
        self.handover = None

    def control(self) -> tuple[bool, bool]:
        """(the driver asked to stop, the elastic policy asked for a handover to a larger group)"""
        return self.stop, self.handover == "requested"

    def handed_over(self) -> bool:
        return self.handover == "done"

    def drain(self) -> list[Event]:
        events, self.events = self.events, []
        return events


def notice_reason(info: Any) -> str:
    """How a stop for Ray's drain notice (a PreemptionInfo) reads in the summary and the log."""
    nodes = info.preempted_node_ids
    which = f"node {nodes[0][:8]} is" if len(nodes) == 1 else f"nodes {', '.join(n[:8] for n in nodes)} are"
    deadline = f", going in {max(info.deadline_ms / 1000 - time.time(), 0):.0f} s" if info.deadline_ms else ""
    return f"Ray's preemption notice: {which} draining{deadline}"


class RayRuntime:
    """The `Runtime` seen by a Ray Train worker (see raylane.loop.protocols.runtime)."""

    def __init__(
        self,
        sink: Any,
        use_gpu: bool,
        streams: dict[str, int | None] | None = None,
        restarts: bool = False,
        driver: dict[str, Any] | None = None,
        replica_group: int | None = None,
    ) -> None:
        ctx = ray.train.get_context()
        # The process that runs this group's fit(): `raylane train`'s, or a sweep's trial.
        self._driver = DriverWatch(ProcessId(**driver) if driver else None, sink)
        self.restarts_without_leaving_nodes = restarts
        self._streams = streams or {}  # the Ray Datasets the driver made: name -> rows per epoch
        self.rank = ctx.get_world_rank()
        self.local_rank = ctx.get_local_rank()
        self.world_size = ctx.get_world_size()
        self.device = ray.train.torch.get_device() if use_gpu else torch.device("cpu")
        self._sink = sink
        self.node_ranks = self._number_nodes_by_id()
        storage = ctx.get_storage()
        # A replica group's Ray run (raylane.onray.replicas) is stored inside the run's folder, as
        # `{run}-g{i}`: its checkpoints are the run's, in the run's folder, shared by every group.
        root = storage.experiment_fs_path if replica_group is None else storage.storage_fs_path
        self.store = DriverWatchedStore(root, storage.storage_filesystem, self.rank, self._driver)
        if self.rank == 0:  # one rank is enough: the per-step vote spreads the request
            threading.Thread(target=self._watch_driver, name="raylane-stop-watch", daemon=True).start()
        # Whatever failure.max_failures says: Ray Train passes the drain notice to every worker
        # in any case (its PreemptionCallback does not depend on FailureConfig), and a run that
        # may not restart must still checkpoint before its node goes, then end.
        threading.Thread(target=self._watch_drain, name="raylane-drain-watch", daemon=True).start()
        preemption.explain_with(self._notice)

    def _number_nodes_by_id(self) -> list[int]:
        """Ray Train numbers nodes by IP address, raylane by Ray node id. The two agree on a real
        cluster and differ where raylets share an address (Ray's fake multi-node cluster,
        host-networked containers): by address, two nodes would look like one, and the HSDP mesh
        (built from LOCAL_WORLD_SIZE) would shard across them. Returns each rank's node rank."""
        node_ranks = node_layout(bytes.fromhex(ray.get_runtime_context().get_node_id()), self.device)
        peers = [r for r, n in enumerate(node_ranks) if n == node_ranks[self.rank]]
        self.local_rank = peers.index(self.rank)
        os.environ.update(
            NODE_RANK=str(node_ranks[self.rank]), LOCAL_RANK=str(self.local_rank), LOCAL_WORLD_SIZE=str(len(peers))
        )
        return node_ranks

    def _watch_driver(self) -> None:
        """Relay the driver's Ctrl-C or SIGTERM as a graceful-stop request, and the elastic
        policy's request for a handover to a larger group (see HeldBatchElasticPolicy)."""
        while not preemption.requested():
            try:
                stop, grow = ray.get(self._sink.control.remote(), timeout=10)
            except ray.exceptions.GetTimeoutError:  # a busy driver's node: ask again
                continue
            except Exception:  # noqa: BLE001 - the driver is gone; Ray tears the group down
                return
            if stop:
                preemption.request("a stop request from the driver")
                return
            if grow and self.restarts_without_leaving_nodes:
                preemption.request_growth()
                return
            time.sleep(DRIVER_STOP_POLL_S)

    def _watch_drain(self) -> None:
        """Ray's own preemption notice: Ray Train's watcher marks every worker when a node of the
        group is draining (a cloud's spot notice, KubeRay's pod termination, `ray drain-node`).
        Read locally, not through ray.train.get_preemption_info(): that is a barrier every rank
        must enter, and the per-step vote already agrees on the step."""
        while not preemption.requested():
            try:
                info = self._preemption_info()
            except Exception:  # noqa: BLE001 - an internal of Ray's that may move: no notice then
                return
            if info is not None:
                leaving = self.rank in info.preempted_ranks
                # Every worker gets it. In a group that restarts without the node, only its own
                # ranks announce it: a vote that heard another rank first would stop the whole
                # run instead of handing over. Elsewhere any rank may.
                if leaving or not self.restarts_without_leaving_nodes:
                    preemption.request(notice_reason(info), node_leaving=leaving)
                return
            time.sleep(DRAIN_POLL_S)

    @staticmethod
    def _preemption_info() -> Any:
        """Ray's drain notice to this worker's group (a PreemptionInfo), None before one."""
        from raylane.onray.internals import get_train_context

        return get_train_context().preemption_context.preemption_info

    def _notice(self) -> str | None:
        """Why the group is stopping, if Ray gave notice: rank 0 names the cause in the summary
        even when another rank read the notice first and the vote stopped the group before rank
        0's own poll (Ray marks every worker within milliseconds; each polls every 0.5 s)."""
        try:
            info = self._preemption_info()
        except Exception:  # noqa: BLE001 - as in _watch_drain: no notice then
            return None
        return notice_reason(info) if info is not None else None

    def publish(self, event: Event) -> None:
        ref = self._sink.put.remote(event)
        if isinstance(event, (End, Handover, SearchEnd)):
            ray.get(ref)  # the driver reads the result after fit() returns: make sure it is there

    def data_stream(self, name: str, source: Any, *, batch_size: int) -> Any | None:
        if name not in self._streams:
            return None
        from raylane.onray.datasets import shard_stream

        return shard_stream(name, source, self._streams, batch_size=batch_size, world_size=self.world_size)


# When Ray Train's backend had set up this worker's process group (see training_starts).


class WarningRelay(logging.Handler):
    """raylane's warnings on a worker, as events for the driver's display: a driver that shows
    only raylane's lines does not relay the workers' output (raylane.logs)."""

    def __init__(self, runtime: RayRuntime) -> None:
        super().__init__(logging.WARNING)
        self._runtime = runtime

    def emit(self, record: logging.LogRecord) -> None:
        # When the driver is gone, the worker's own log file still has the warning.
        with contextlib.suppress(Exception):
            self._runtime.publish(
                Log(rank=self._runtime.rank, level=record.levelname.lower(), message=record.getMessage())
            )


def relay_warnings(runtime: RayRuntime, verbose: bool) -> None:
    if verbose:
        return  # the worker's output reaches the driver as it is
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    own = logging.getLogger("raylane")
    for handler in [h for h in own.handlers if isinstance(h, WarningRelay)]:
        own.removeHandler(handler)  # a worker process reused by a later run
    own.addHandler(WarningRelay(runtime))
