"""Ray launcher: runs the worker function it is handed (`train_worker`: raylane.loop.run.run_worker)
on Ray Train V2 workers (one per GPU; gloo on CPU), and pumps rank 0's events to the driver until
the group ends.

The pieces it puts together: the worker's side of Ray (`RayRuntime`, the `EventSink` actor:
raylane.onray.runtime), what each worker is handed (`LaunchSpec`: raylane.onray.spec) and the
TorchTrainer subclasses (raylane.onray.trainers)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from raylane import logs, pipelines_ref
from raylane.config import BaseConfig, validate
from raylane.config.batching import HeldBatch, world_sizes
from raylane.loop import preemption
from raylane.loop.protocols.events import End, Event, Startup
from raylane.loop.protocols.result import RunResult
from raylane.onray.elastic import HANDOVER_WAIT_S, NodeLeaving, failure_config, max_failures, ray_num_workers
from raylane.onray.fit import Fit, Group, event_sink
from raylane.onray.leftovers import ProcessId
from raylane.onray.placement import put_env, scaling_options
from raylane.onray.runtime import RayRuntime, relay_warnings
from raylane.onray.spec import SPEC_KEY, LaunchSpec, Worker, launch_spec
from raylane.onray.trainers import (
    DriverTorchTrainer,
    EmbeddedTorchTrainer,
    RaylaneTorchConfig,
    TrialTorchTrainer,
    process_group_unix,
)
from raylane.runrecord import run_folder
from raylane.session import FIND

log = logging.getLogger("raylane")

EVENT_POLL_S = 0.25
LISTENER_STOP_GRACE_S = 60.0


def _train_fn(train_loop_config: dict[str, Any]) -> None:
    # Ray logs every report and checkpoint at INFO; the driver's display already shows them.
    # (One of those loggers is named after its file path, not its module.)
    from raylane.loop.observe.startup import process_start_unix
    from raylane.onray.internals import train_context_module as ray_train_context

    startup = {
        "worker_process": process_start_unix(),
        "process_group": process_group_unix(),
        "worker_imports": time.time(),
    }

    _threads_as_ray_set()
    for name in ("ray.train", ray_train_context.__file__):
        logging.getLogger(name).setLevel(logging.WARNING)

    spec = launch_spec(train_loop_config)
    cfg = validate(spec.config)
    runtime = RayRuntime(
        spec.sink,
        cfg.scaling.use_gpu,
        spec.streams,
        restarts=spec.restarts,
        driver=dataclasses.asdict(spec.driver),
        replica_group=spec.replica_group,
    )
    relay_warnings(runtime, spec.verbose)
    if startup["worker_process"] is not None:  # was this rank's process a warm worker? (the summary says)
        spec.sink.put.remote(Startup(phases={}, processes={f"rank {runtime.rank}": startup["worker_process"]}))
    spec.worker(cfg, runtime, spec, {k: v for k, v in startup.items() if v is not None})


def _threads_as_ray_set() -> None:
    """torch's thread count as OMP_NUM_THREADS says (Ray sets it to the actor's CPUs as the actor
    starts): a warm worker imported torch before that, and torch kept the machine's core count,
    which on 2 ranks per 2 cores would oversubscribe them (seen: 2 threads under OMP_NUM_THREADS=1)."""
    import os

    import torch

    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if wanted.isdigit() and int(wanted) > 0 and torch.get_num_threads() != int(wanted):
        torch.set_num_threads(int(wanted))


def train_worker(cfg: BaseConfig, runtime: RayRuntime, spec: LaunchSpec, startup: dict[str, float]) -> None:
    """A training run's worker (`raylane train`, a sweep's trial): raylane.loop.run.run_worker."""
    from raylane.loop.run import run_worker
    from raylane.tracking.runs import rank_zero_logger

    metric_logger = None
    if runtime.rank == 0 and spec.run_id:
        folder = Path(spec.run_folder) if spec.run_folder else None
        metric_logger = rank_zero_logger(cfg, spec.tracking_uri, spec.run_id, folder)
    result = run_worker(cfg, runtime, metric_logger, startup, held=spec.held)
    if result.growing:
        # Checkpointed for a larger group: Ray's elastic policy now stops this one and starts
        # that (a return would end the run). Should it not come, a restart does the same.
        time.sleep(HANDOVER_WAIT_S + 60)
    if result.node_leaving or result.growing:
        raise NodeLeaving(
            f"{result.stop_reason}: checkpointed at step {result.steps}, restarting without the leaving node"
        )


def pump(
    thread: threading.Thread,
    drain: Callable[[], list[Event]],
    request_stop: Callable[[], Any],
    on_event: Callable[[Event], None],
) -> RunResult | None:
    """Relay rank 0's events until `thread` (fit) has ended and its last events are read; returns
    what End carried, None when no End came (an autotune search's ends with SearchEnd, which its
    listener reads)."""
    ended: RunResult | None = None
    relayed = False
    while True:
        thread.join(EVENT_POLL_S)
        # Read before draining: a fit that ends between the drain and a later look would leave
        # rank 0's last events (its End) in the sink, and the run would end without its result.
        finished = not thread.is_alive()
        if preemption.requested() and not relayed:
            request_stop()  # the workers checkpoint at the next step and return
            relayed = True
        try:
            for event in drain():
                if isinstance(event, End):
                    ended = event.result
                on_event(event)
        except BaseException:
            # A listener gave up on the run (a Tune scheduler stopping this trial): stop the
            # workers at their next step boundary, so that the run ends and releases its workers
            # and placement group instead of holding them until something kills them.
            request_stop()
            thread.join(LISTENER_STOP_GRACE_S)
            raise
        if finished:
            return ended


def _ray_datasets(cfg: BaseConfig, pipeline: pipelines_ref.Resolved) -> tuple[dict[str, Any], dict[str, int | None]]:
    """The pipeline's streaming sources as Ray Datasets, with what the workers need to know of
    them; ({}, {}) for a map-style pipeline (without importing Ray Data)."""
    if not pipeline.streams:
        return {}, {}
    from raylane.onray.datasets import build_datasets

    return build_datasets(cfg)


def _stream_split():
    from raylane.onray.datasets import StreamSplit

    return StreamSplit()


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
    env: Any = None,
    sink_name: str | None = None,
    folder: Path | None | Literal["find"] = FIND,
    pipeline: pipelines_ref.Resolved | None = None,
    held: HeldBatch | None = None,
) -> RunResult | None:
    """Run `worker` on a worker group of the connected cluster (see
    `raylane.onray.cluster.start_ray`), passing rank 0's events to `on_event`; returns what rank
    0's End carried (a training run's RunResult), None when no End came (a search's SearchEnd
    goes to `on_event` with the rest). The caller shuts Ray down. `in_trial`: a Tune trial's run,
    whose controller Tune may kill while the sweep goes on. `restartable`: the group may restart
    without a node that leaves (failure.max_failures permitting), as a training run's does; a
    search's does not. `env`: the `env:` variables already in Ray's object store (a sweep's driver
    resolved them: a trial runs elsewhere); None: resolved here, in the driver. `sink_name`: the
    event sink's, for a stop asked from another process (a sweep's driver: raylane.onray.trials).
    `folder`, `pipeline` and `held` (the global batch held on the planned world): the run's, as
    the driver found them (`raylane train`); a trial's and a search's are found here (and their
    ranks hold their batch). With `fault_tolerance.enabled`, one worker group per replica group
    (raylane.onray.replicas)."""
    folder = run_folder(cfg) if isinstance(folder, str) else folder
    trainer_cls = TrialTorchTrainer if in_trial else EmbeddedTorchTrainer if embedded else DriverTorchTrainer
    resolved = pipeline or pipelines_ref.resolve(cfg.pipeline)
    launch = Launch(cfg, worker, run_id, tracking_uri, folder, resolved, trainer_cls, restartable, held)
    if cfg.fault_tolerance.enabled:
        from raylane.onray.replicas import launch_replicas

        return launch_replicas(launch, on_event, pump, env, loopback=embedded)
    fit = launch.fit(event_sink(sink_name), put_env(cfg, folder) if env is None else env)
    on_event(Startup(phases={"fit": time.time()}))
    ended = pump(fit.start(), fit.drain, fit.request_stop, on_event)
    if (failure := fit.failure()) is not None:
        raise failure
    return ended


@dataclasses.dataclass(frozen=True)
class Launch:
    """What every worker group of one launch starts from: the run's config and what the driver
    found for it (its folder, its pipeline, the global batch held on the planned world), the
    worker function, the MLflow run, and the TorchTrainer for the way the run meets Ray. A run
    has one group; a fault-tolerant run one per replica group (raylane.onray.replicas)."""

    cfg: BaseConfig
    worker: Worker
    run_id: str | None
    tracking_uri: str
    folder: Path | None
    pipeline: pipelines_ref.Resolved
    trainer_cls: type[TorchTrainer]
    restartable: bool = True
    held: HeldBatch | None = None

    def fit(self, sink: Any, env: Any, group: Group | None = None) -> Fit:
        """A worker group's fit (not started), its rank 0 sending to `sink`, with `env` (the `env:`
        variables in Ray's object store); `group`: the run's own when None."""
        cfg = self.cfg
        group = group or Group(cfg.run.name, cfg.run.storage_path, ray_num_workers(cfg))
        spec = self.spec(sink, group.replica_group)
        size = group.num_workers if isinstance(group.num_workers, int) else group.num_workers[1]
        return Fit(self.trainer(spec, env, group), sink, size)

    def spec(self, sink: Any, replica_group: int | None = None) -> LaunchSpec:
        """What each worker of the group is handed (raylane.onray.spec): the config as JSON, the
        worker function, the event sink, this process (whose end stops the workers), the MLflow
        run, the run's folder, an elastic run's world sizes, whether the group restarts, the held
        batch, the replica group. Its streams are the TorchTrainer's to add (`trainer`)."""
        cfg = self.cfg
        return LaunchSpec(
            config=cfg.model_dump(mode="json"),
            worker=self.worker,
            sink=sink,
            driver=ProcessId.here(),
            run_id=self.run_id,
            tracking_uri=self.tracking_uri,
            run_folder=str(self.folder) if self.folder else None,
            verbose=logs.verbose(),
            world_sizes=world_sizes(cfg) if cfg.scaling.elastic else None,
            restarts=max_failures(cfg) != 0 and self.restartable,
            held=self.held,
            replica_group=replica_group,
        )

    def trainer(self, spec: LaunchSpec, env: Any, group: Group) -> TorchTrainer:
        """The TorchTrainer that runs `spec.worker` on `group`, with the pipeline's streaming
        sources as Ray Datasets (`spec.streams`: their rows per epoch) and `env`."""
        cfg = self.cfg
        datasets, streams = _ray_datasets(cfg, self.pipeline)
        return self.trainer_cls(
            _train_fn,
            train_loop_config={SPEC_KEY: dataclasses.replace(spec, streams=streams)},
            datasets=datasets,
            **({"dataset_config": _stream_split()} if datasets else {}),
            scaling_config=ScalingConfig(
                num_workers=group.num_workers,
                use_gpu=cfg.scaling.use_gpu,
                elastic_resize_monitor_interval_s=cfg.scaling.resize_check_s,
                **scaling_options(cfg),
            ),
            torch_config=RaylaneTorchConfig(timeout_s=cfg.dist.timeout_s, restarts=spec.restarts, env=env),
            run_config=RunConfig(
                name=group.name,
                storage_path=group.storage_path,
                failure_config=failure_config(cfg),
            ),
        )
