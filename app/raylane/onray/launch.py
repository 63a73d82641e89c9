"""Ray launcher: runs the worker function it is handed (`train_worker`: raylane.loop.run.run_worker)
on Ray Train V2 workers (one per GPU; gloo on CPU).

This is where Ray lives for training: the embedded or joined cluster, the TorchTrainer, the
`RayRuntime` the loop sees, and the small actor through which rank 0's progress reaches the
driver's display."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.train
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from raylane import logs
from raylane.config import BaseConfig, validate
from raylane.config.batching import world_sizes
from raylane.errors import TrainingError
from raylane.loop import preemption
from raylane.loop.distributed import node_layout
from raylane.loop.events import End, Event, Handover, Log, Startup
from raylane.loop.result import RunResult
from raylane.onray.elastic import (
    HANDOVER_WAIT_S,
    HandoverFailurePolicy,
    HeldBatchElasticPolicy,
    NoAutoscalerScalingPolicy,
    NodeLeaving,
    max_failures,
    ray_num_workers,
)
from raylane.onray.failures import format_failure
from raylane.onray.internals import ControllerCallback, TorchBackend
from raylane.onray.leftovers import DriverWatch, ProcessId
from raylane.onray.store import DriverWatchedStore

log = logging.getLogger("raylane")

EVENT_POLL_S = 0.25
DRIVER_STOP_POLL_S = 0.5
DRAIN_POLL_S = 0.5  # Ray Train polls node drains every 5 s itself
LISTENER_STOP_GRACE_S = 60.0


@ray.remote(num_cpus=0)
class EventSink:
    """Holds rank 0's events until the driver drains them, and the driver's stop request."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.stop = False
        self.handover: str | None = None  # a larger group fits: None, "requested", then "done"

    def put(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, Handover) and self.handover == "requested":
            self.handover = "done"

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


class RayRuntime:
    """The `Runtime` seen by a Ray Train worker (see raylane.loop.runtime)."""

    def __init__(
        self,
        sink: Any,
        use_gpu: bool,
        streams: dict[str, int | None] | None = None,
        restarts: bool = False,
        driver: dict[str, Any] | None = None,
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
        self.store = DriverWatchedStore(storage.experiment_fs_path, storage.storage_filesystem, self.rank, self._driver)
        if self.rank == 0:  # one rank is enough: the per-step vote spreads the request
            threading.Thread(target=self._watch_driver, name="raylane-stop-watch", daemon=True).start()
        if restarts:
            threading.Thread(target=self._watch_drain, name="raylane-drain-watch", daemon=True).start()

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
        from raylane.onray.internals import get_train_context

        while not preemption.requested():
            try:
                info = get_train_context().preemption_context.preemption_info
            except Exception:  # noqa: BLE001 - an internal of Ray's that may move: no notice then
                return
            if info is not None:  # every worker gets it: the ranks on the leaving node announce it
                if self.rank in info.preempted_ranks:
                    preemption.request("Ray's preemption notice", node_leaving=True)
                return
            time.sleep(DRAIN_POLL_S)

    def publish(self, event: Event) -> None:
        ref = self._sink.put.remote(event)
        if isinstance(event, (End, Handover)):
            ray.get(ref)  # the driver reads the result after fit() returns: make sure it is there

    def data_stream(self, name: str, source: Any, *, batch_size: int) -> Any | None:
        if name not in self._streams:
            return None
        from raylane.onray.datasets import shard_stream

        return shard_stream(name, source, self._streams, batch_size=batch_size, world_size=self.world_size)


# When Ray Train's backend had set up this worker's process group (see _training_starts).
_process_group_unix: float | None = None


def _training_starts(restarts: bool) -> None:
    # Runs on each worker actor's main thread, the only one that may set signal handlers (the
    # training function runs on another). Ray's own handler (exit) stays the fallback.
    import signal

    global _process_group_unix
    _process_group_unix = time.time()  # the backend's on_start (init_process_group) came first
    # A Ray worker gets SIGTERM from its node going away (a spot reclaim's shutdown), which a run
    # that restarts its group treats as that node's notice; the driver's own stop reaches it
    # through the event sink instead. Set here, not in RayRuntime: the notice may come before.
    preemption.signals_mean_node_leaving(restarts)
    preemption.install((signal.SIGTERM,), early=True)


class _RaylaneTorchBackend(TorchBackend):
    def on_training_start(self, worker_group, backend_config) -> None:
        super().on_training_start(worker_group, backend_config)
        worker_group.execute(_training_starts, backend_config.restarts)


@dataclasses.dataclass
class _RaylaneTorchConfig(TorchConfig):
    """TorchConfig whose workers turn SIGTERM into a graceful stop (see raylane.loop.preemption).
    `restarts`: the group restarts without a leaving node (see `LaunchSpec.restarts`)."""

    restarts: bool = False

    @property
    def backend_cls(self):
        return _RaylaneTorchBackend


class _RaylaneTorchTrainer(TorchTrainer):
    """TorchTrainer without Ray Data's dataset manager unless the run streams Ray Data: map-style
    pipelines feed their own DataLoaders, yet Ray Train starts that manager as an actor (a
    process importing Ray, ~3 s of CPU on 2 cores) on the way to the first step even when the
    trainer is given no datasets."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        failures = self.run_config.failure_config or FailureConfig()
        controller_init_kwargs["failure_policy"] = HandoverFailurePolicy(failures)
        spec = launch_spec(self.train_loop_config)
        if self.scaling_config.elasticity_enabled and spec.world_sizes:
            controller_init_kwargs["scaling_policy"] = HeldBatchElasticPolicy(
                self.scaling_config, spec.world_sizes, spec.sink
            )
        return super()._initialize_and_run_controller(**controller_init_kwargs)

    def _create_default_callbacks(self):
        from raylane.onray.internals import DatasetsCallback

        callbacks = [*super()._create_default_callbacks(), _ControllerStarted(launch_spec(self.train_loop_config).sink)]
        return callbacks if self.datasets else [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]


class _ControllerStarted(ControllerCallback):
    """Tells the driver when Ray Train's controller is up: a start-up phase (raylane.loop.startup)."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink

    def after_controller_start(self, train_run_context) -> None:
        self._sink.put.remote(Startup(phases={"controller": time.time()}))


class _DriverTorchTrainer(_RaylaneTorchTrainer):
    """The run of a `raylane train` driver, without the detached placement-group cleaner actor
    (a process importing Ray Train: ~2 s of CPU and ~600 MB per run). The cleaner removes the
    run's placement group when its controller dies while the job goes on, as when Tune kills a
    trial. Here the driver is the job: the controller dies with it or ends it, and Ray removes a
    job's placement groups when the job ends."""

    def _create_default_callbacks(self):
        from raylane.onray.internals import PlacementGroupCleanerCallback

        return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, PlacementGroupCleanerCallback)]


class _EmbeddedTorchTrainer(_DriverTorchTrainer):
    """On an embedded cluster, also without autoscaler requests (see NoAutoscalerScalingPolicy)."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if not self.scaling_config.elasticity_enabled:  # an elastic run keeps Ray's own policy, requests and all
            controller_init_kwargs["scaling_policy"] = NoAutoscalerScalingPolicy(self.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)


# The key of Ray Train's `train_loop_config` under which the workers get their LaunchSpec.
SPEC_KEY = "spec"


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What the driver hands each Ray Train worker (in Ray Train's `train_loop_config`, pickled
    across Ray): the run's config, the function the worker group runs (`worker`, as Ray Train
    takes `train_loop_per_worker`: `train_worker` for a training run, autotune's search for a
    search), and what connects the workers to the driver."""

    config: dict[str, Any]  # the run's config as JSON, validated again on the worker (its pipeline's own class)
    worker: Worker
    sink: Any  # the driver's EventSink actor
    driver: ProcessId  # the process whose end stops the workers (raylane.onray.leftovers)
    run_id: str | None = None  # the MLflow run rank 0 logs metrics to
    tracking_uri: str = ""
    streams: dict[str, int | None] = dataclasses.field(default_factory=dict)  # Ray Datasets: name -> rows per epoch
    verbose: bool = False  # the workers' own output reaches the driver (raylane.logs)
    world_sizes: list[int] | None = None  # an elastic run's sizes that hold the global batch
    restarts: bool = False  # the group restarts without a node that leaves, rather than the run stopping


# A worker group's function: (the run's config, the worker's runtime, the launch, its start-up
# phases so far) -> None. Its results reach the driver as rank 0's events (an End).
Worker = Callable[[BaseConfig, RayRuntime, LaunchSpec, dict[str, float]], None]


def launch_spec(train_loop_config: dict[str, Any]) -> LaunchSpec:
    """The LaunchSpec inside Ray Train's `train_loop_config` (on the driver, and on a worker)."""
    return train_loop_config[SPEC_KEY]


def _train_fn(train_loop_config: dict[str, Any]) -> None:
    # Ray logs every report and checkpoint at INFO; the driver's display already shows them.
    # (One of those loggers is named after its file path, not its module.)
    from raylane.loop.startup import process_start_unix
    from raylane.onray.internals import train_context_module as ray_train_context

    startup = {
        "worker_process": process_start_unix(),
        "process_group": _process_group_unix,
        "worker_imports": time.time(),
    }

    for name in ("ray.train", ray_train_context.__file__):
        logging.getLogger(name).setLevel(logging.WARNING)

    spec = launch_spec(train_loop_config)
    cfg = validate(spec.config)
    runtime = RayRuntime(
        spec.sink, cfg.scaling.use_gpu, spec.streams, restarts=spec.restarts, driver=dataclasses.asdict(spec.driver)
    )
    _relay_warnings(runtime, spec.verbose)
    spec.worker(cfg, runtime, spec, {k: v for k, v in startup.items() if v is not None})


def train_worker(cfg: BaseConfig, runtime: RayRuntime, spec: LaunchSpec, startup: dict[str, float]) -> None:
    """A training run's worker (`raylane train`, a sweep's trial): raylane.loop.run.run_worker."""
    from raylane.loop.run import run_worker
    from raylane.tracking.runs import rank_zero_logger

    metric_logger = None
    if runtime.rank == 0 and spec.run_id:
        metric_logger = rank_zero_logger(cfg, spec.tracking_uri, spec.run_id)
    result = run_worker(cfg, runtime, metric_logger, startup)
    if result.growing:
        # Checkpointed for a larger group: Ray's elastic policy now stops this one and starts
        # that (a return would end the run). Should it not come, a restart does the same.
        time.sleep(HANDOVER_WAIT_S + 60)
    if result.node_leaving or result.growing:
        raise NodeLeaving(
            f"{result.stop_reason}: checkpointed at step {result.steps}, restarting without the leaving node"
        )


class _WarningRelay(logging.Handler):
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


def _relay_warnings(runtime: RayRuntime, verbose: bool) -> None:
    if verbose:
        return  # the worker's output reaches the driver as it is
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    own = logging.getLogger("raylane")
    for handler in [h for h in own.handlers if isinstance(h, _WarningRelay)]:
        own.removeHandler(handler)  # a worker process reused by a later run
    own.addHandler(_WarningRelay(runtime))


def _fit_and_pump(
    trainer: TorchTrainer, sink: Any, on_event: Callable[[Event], None], world_size: int
) -> RunResult | dict[str, Any] | None:
    """fit() runs on a helper thread so that this (main) thread keeps Ctrl-C and SIGTERM: Ray
    installs its own SIGINT handler only from the main thread. Here we relay rank 0's events."""
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # re-raised on the main thread
            outcome["error"] = exc

    thread = threading.Thread(target=fit, name="raylane-fit", daemon=True)
    thread.start()
    ended: RunResult | dict[str, Any] | None = None  # End's result: training's, or autotune's search's
    relayed = False
    while True:
        thread.join(EVENT_POLL_S)
        if preemption.requested() and not relayed:
            sink.request_stop.remote()  # the workers checkpoint at the next step and return
            relayed = True
        try:
            for event in ray.get(sink.drain.remote()):
                if isinstance(event, End):
                    ended = event.result
                on_event(event)
        except BaseException:
            # A listener gave up on the run (a Tune scheduler stopping this trial): stop the
            # workers at their next step boundary, so that the run ends and releases its workers
            # and placement group instead of holding them until something kills them.
            sink.request_stop.remote()
            thread.join(LISTENER_STOP_GRACE_S)
            raise
        if not thread.is_alive():
            break
    if "error" in outcome:
        exc = outcome["error"]
        if isinstance(exc, ray.train.TrainingFailedError):
            raise TrainingError(format_failure(exc, world_size)) from None
        raise exc
    return ended


def _ray_datasets(cfg: BaseConfig) -> tuple[dict[str, Any], dict[str, int | None]]:
    """The pipeline's streaming sources as Ray Datasets, with what the workers need to know of
    them; ({}, {}) for a map-style pipeline (without importing Ray Data)."""
    from raylane.loop.streaming import declares_sources

    if not declares_sources(cfg):
        return {}, {}
    from raylane.onray.datasets import build_datasets

    return build_datasets(cfg)


def _stream_split():
    from raylane.onray.datasets import StreamSplit

    return StreamSplit()


def _event_sink() -> Any:
    """The driver's event sink, on the driver's own node: anywhere else, losing that node (a spot
    reclaim that an elastic run should survive) would end the run with it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    return EventSink.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True)).remote()


def launch_on_ray(
    cfg: BaseConfig,
    run_id: str | None,
    tracking_uri: str,
    on_event: Callable[[Event], None],
    *,
    embedded: bool,
    worker: Worker,
    in_trial: bool = False,
    restartable: bool = True,
) -> RunResult | dict[str, Any] | None:
    """Run `worker` on a worker group of the connected cluster (see
    `raylane.onray.cluster.start_ray`), passing rank 0's events to `on_event`; returns what rank
    0's End carried (a training run's RunResult, a search's outcome), None when no End came. The
    caller shuts Ray down. `in_trial`: a Tune trial's run, whose controller Tune may kill while the
    sweep goes on. `restartable`: the group may restart without a node that leaves
    (failure.max_failures permitting), as a training run's does; a search's does not."""
    sink = _event_sink()
    resources = {"CPU": cfg.scaling.cpus_per_worker}
    if cfg.scaling.use_gpu:
        resources["GPU"] = cfg.scaling.gpus_per_worker
    trainer_cls = _RaylaneTorchTrainer if in_trial else _EmbeddedTorchTrainer if embedded else _DriverTorchTrainer
    datasets, streams = _ray_datasets(cfg)
    restarts = max_failures(cfg) != 0 and restartable
    spec = LaunchSpec(
        config=cfg.model_dump(mode="json"),
        worker=worker,
        sink=sink,
        driver=ProcessId.here(),
        run_id=run_id,
        tracking_uri=tracking_uri,
        streams=streams,
        verbose=logs.verbose(),
        world_sizes=world_sizes(cfg) if cfg.scaling.elastic else None,
        restarts=restarts,
    )
    trainer = trainer_cls(
        _train_fn,
        train_loop_config={SPEC_KEY: spec},
        datasets=datasets,
        **({"dataset_config": _stream_split()} if datasets else {}),
        scaling_config=ScalingConfig(
            num_workers=ray_num_workers(cfg),
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker=resources,
            elastic_resize_monitor_interval_s=cfg.scaling.resize_check_s,
        ),
        torch_config=_RaylaneTorchConfig(timeout_s=cfg.dist.timeout_s, restarts=restarts),
        run_config=RunConfig(
            name=cfg.run.name,
            storage_path=cfg.run.storage_path,
            failure_config=FailureConfig(max_failures=max_failures(cfg)),
        ),
    )
    on_event(Startup(phases={"fit": time.time()}))
    return _fit_and_pump(trainer, sink, on_event, cfg.scaling.num_workers)
