"""The driver's side of a run, whichever launcher runs the ranks: name the run and take its lease
(`finalize_run`, also a search's), open its MLflow run, show progress, close the run with the right
status and write the summary. The lifecycle (lease, MLflow run, status, interrupts) is
raylane.session's, as for every launch."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from raylane.config import BaseConfig, ConfigError
from raylane.config.batching import HeldBatch
from raylane.loop.protocols.events import Event
from raylane.loop.protocols.result import RunResult
from raylane.pipelines_ref import Resolved
from raylane.results import Status, TrainSummary
from raylane.runrecord import fresh_name, fresh_start, record_finished, run_folder
from raylane.session import (
    FIND,
    RunSession,
    TorchrunEnding,
    import_exclusively,
    not_started,
    outcome,
    raise_interrupt,
    ran,
    status_of,
)
from raylane.tracking.progress import LABEL_WIDTH, ProgressDisplay

log = logging.getLogger("raylane")

NOT_STARTED = "interrupted before training started"  # the summary's error


def _torchrun_rank_done(session: RunSession, world_size: int, stopped: bool) -> None:
    """Training is over on this torchrun rank. Only after a graceful stop do the ranks wait for
    each other before they leave (raylane.loop.distributed.groups.leave_process_group): the end of a
    finished run is no collective, so rank 0's end-of-run records, however long, cannot turn it
    into a failure on another rank's timeout."""
    from raylane.loop.distributed.groups import leave_process_group

    if world_size > 1:
        # When another rank failed, torchrun now SIGTERMs the survivors (and SIGKILLs them 30 s
        # later): rank 0 still has to close the MLflow run and write the summary, so it finishes
        # that first. Ctrl-C still interrupts.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    session.defer(leave_process_group, wait_for_peers=stopped)  # runs last: after rank 0's summary


def train(
    cfg: BaseConfig,
    *,
    use_ray: bool,
    folder: Path | None,
    pipeline: Resolved,
    address: str | None = None,
    summary_path: str | None = None,
    register: str | None = None,
    held: HeldBatch | None = None,
) -> TrainSummary:
    """Run training to the end; returns the summary (on a torchrun rank other than 0, only its
    `status` and `error`), whose `exit_code` is the command's. `folder`, `pipeline` and `held`
    (the global batch held on the planned world): the run's as the checks before it found them
    once (raylane.api.PreparedRun); `address`: the cluster a Ray run joins, as they resolved it."""
    from raylane.loop import preemption
    from raylane.loop.distributed.groups import env_ranks
    from raylane.tracking.runs import open_run

    run = _Driving.start(cfg, use_ray, folder, summary_path, register)
    with RunSession() as session:
        cfg = finalize_run(cfg, session, run.is_driver, folder)
        session.closes_as_run(cfg)
        # Opening the MLflow run (import + database) overlaps with starting Ray.
        pool = session.enter(ThreadPoolExecutor(2, thread_name_prefix="raylane-start"))
        run.world_size = cfg.scaling.num_workers if use_ray else env_ranks()[2]
        if run.is_driver and cfg.mlflow.enabled:
            session.open_on(pool, open_run, cfg, run.tracking_uri, run.world_size, session.folder)
        try:
            ray_stopper = None
            if use_ray:  # Ray's imports take turns with the MLflow opener's on the pool (session.HEAVY_IMPORTS)
                import_exclusively("raylane.onray.cluster", "raylane.onray.launch")
                from raylane.onray.cluster import start_ray

                ray_stopper = start_ray(cfg, address, pool, run.startup)
                session.defer(ray_stopper.wait)  # last, after the summary is out
        except BaseException as exc:  # noqa: BLE001 - each way out closes the MLflow run
            not_started(session, exc)  # raised again unless an interrupt
            return TrainSummary(status=status_of(exc), error=NOT_STARTED, run_name=cfg.run.name)
        # From here on, a first SIGTERM or Ctrl-C asks the ranks to checkpoint and stop.
        preemption.install()
        ending = None if use_ray or run.world_size < 2 else TorchrunEnding(env_ranks()[0])
        watch = _Watchers.start(cfg, session.handle(), run)  # the handle: None when MLflow is off or unreachable
        run_id = watch.handle.run_id if watch.handle else None
        with _ended(cfg, ending, watch.display) as ended, preemption.armed():
            if use_ray:
                from raylane.onray.launch import launch_on_ray, train_worker

                embedded = bool(ray_stopper and ray_stopper.embedded)
                where: dict[str, Any] = {"folder": session.folder, "pipeline": pipeline, "held": held}
                ended.result = launch_on_ray(
                    cfg, run_id, run.tracking_uri, watch.on_event, embedded=embedded, worker=train_worker, **where
                )
            else:
                from raylane.loop.run import launch_local

                logger = _rank_zero_logger(cfg, run.tracking_uri, run_id, session.folder)
                ended.result = launch_local(cfg, watch.on_event, logger, held)
        return _finish(cfg, session, run, watch, ended, ray_stopper, ending.said if ending else [])


@dataclass
class _Driving:
    """What the driver keeps of the run it drives from its start to its summary."""

    use_ray: bool
    is_driver: bool  # on Ray, or torchrun's rank 0
    tracking_uri: str
    launched: float
    startup: Any  # raylane.loop.observe.startup.StartupTimes
    summary_path: str | None
    register: str | None
    world_size: int = 0

    @staticmethod
    def start(
        cfg: BaseConfig, use_ray: bool, folder: Path | None, summary_path: str | None, register: str | None
    ) -> _Driving:
        """The driver's first steps: SIGTERM as Ctrl-C, and under torchrun or in one process the
        rank's prelude (env:, NCCL's flight recorder, the process group: the ranks agree on the
        run name first)."""
        from raylane.loop.data import baddata
        from raylane.loop.distributed.groups import env_ranks
        from raylane.loop.observe.startup import StartupTimes
        from raylane.tracking.runs import resolve_tracking_uri

        launched = time.time()
        startup = StartupTimes()
        if not use_ray:
            from raylane.loop.run import prelude  # the loop this process runs: its imports are the driver's
        baddata.forget_skipped()  # a second raylane.train() in this process counts its own data
        startup.mark("driver_imports")
        signal.signal(signal.SIGTERM, raise_interrupt)  # before training can stop gracefully: like Ctrl-C
        if not use_ray:
            prelude(cfg, folder)
            startup.mark("process_group")
        is_driver = use_ray or env_ranks()[0] == 0
        return _Driving(use_ray, is_driver, resolve_tracking_uri(), launched, startup, summary_path, register)


@dataclass
class _Watchers:
    """What hears rank 0's events on the driver, in this order: the resizes, the progress display,
    the MLflow recorder, the start-up phases; and the nodes' health watch. The display and the
    recorder are None where there is none (a torchrun rank other than 0; MLflow off or
    unreachable, `handle` None: training does not wait for tracking)."""

    handle: Any
    display: ProgressDisplay | None
    recorder: Any
    resizes: Any
    health: Any
    listeners: list[Callable[[Event], None]]

    @staticmethod
    def start(cfg: BaseConfig, handle: Any, run: _Driving) -> _Watchers:
        from raylane.tracking.health import start_watch
        from raylane.tracking.records import RunRecorder
        from raylane.tracking.resizes import Resizes

        if handle:
            run.startup.mark("tracking")
            log.info("run %s (MLflow run %s%s)", cfg.run.name, handle.run_id, ", continued" if handle.resumed else "")
        display = ProgressDisplay() if run.is_driver else None
        recorder = RunRecorder(handle, cfg, prewarm=run.use_ray) if handle else None
        resizes = Resizes()
        listeners = [x.handle if x is display else x.on_event for x in (resizes, display, recorder) if x is not None]
        health = start_watch(cfg, handle.tracking_uri, handle.run_id) if handle else None
        return _Watchers(handle, display, recorder, resizes, health, [*listeners, run.startup.on_event])

    def on_event(self, event: Event) -> None:
        for listener in self.listeners:
            listener(event)


def _rank_zero_logger(cfg: BaseConfig, tracking_uri: str, run_id: str | None, folder: Path | None) -> Any:
    """Rank 0's MLflow logger in a launch here (the loop itself knows nothing of MLflow)."""
    from raylane.loop.distributed.groups import env_ranks
    from raylane.tracking.runs import rank_zero_logger

    return rank_zero_logger(cfg, tracking_uri, run_id, folder) if run_id and env_ranks()[0] == 0 else None


@dataclass
class _Ended:
    """How the launch in `_ended`'s block ended: its MLflow status, the error line, and what rank
    0's End carried (None: the run failed, or no End came)."""

    status: Status = Status.FINISHED
    error: str | None = None
    result: RunResult | None = None
    bad_input: ConfigError | None = None  # what only the ranks could tell (a pipeline's build refusing its config)


@contextlib.contextmanager
def _ended(cfg: BaseConfig, ending: TorchrunEnding | None, display: ProgressDisplay | None) -> Iterator[_Ended]:
    """Around the launch: how it ended, an error or an interrupt included (the launcher's message
    names the rank and its exception; raylane.session maps the status). `ending`: a torchrun
    rank's, of several."""
    ended = _Ended()
    try:
        yield ended
    except (KeyboardInterrupt, Exception) as exc:
        ended.status, ended.error = ending.ended(exc) if ending else outcome(exc)
        ended.result = None
        ended.bad_input = exc if isinstance(exc, ConfigError) else None
    else:
        result = ended.result
        ended.status = ran(bool(result is not None and result.preempted))
        if result is not None and ended.status == Status.KILLED:
            ended.error = (
                f"stopped at step {result.steps} ({result.stop_reason}); "
                f"checkpoint saved: relaunch with run.name={cfg.run.name} to resume"
            )
    finally:
        if ending:
            ending.over = True
        if display:
            display.close()


def _finish(
    cfg: BaseConfig,
    session: RunSession,
    run: _Driving,
    watch: _Watchers,
    ended: _Ended,
    ray_stopper: Any,
    failed_ranks: list[Any],
) -> TrainSummary:
    """Once the ranks are done: Ray stopping meanwhile (`ray_stopper`, on Ray), the end-of-run
    records, the MLflow run's close (with the error line as a tag), the run's record and the
    summary; `failed_ranks`: under torchrun, the other ranks whose failure the error names
    (raylane.loop.observe.rankfailures.RankFailure), whose logs are named below it."""
    from raylane.tracking.health import stop_watch
    from raylane.tracking.runs import ui_command

    stop_watch(watch.health)  # the nodes' last samples logged; a node silent at the end is not named
    if ray_stopper:
        ray_stopper.start()  # the records below need MLflow, not Ray
    else:
        _torchrun_rank_done(session, run.world_size, stopped=bool(ended.result and ended.result.preempted))

    if not run.is_driver:
        if ended.bad_input is not None:
            raise ended.bad_input  # exit 2 on every torchrun rank; rank 0 says it (raylane.cli)
        return TrainSummary(status=ended.status, error=ended.error, run_name=cfg.run.name)
    result = ended.result
    fields = _summary(cfg, watch.handle, ended.status, ended.error, result, watch.display, run.launched, run.startup)
    fields.update(world_size=result.world_size if result else run.world_size, resizes=watch.resizes.resizes)
    if cfg.fault_tolerance.enabled:  # a group's result says its own world; the run's is every group's
        fields.update(
            world_size=run.world_size, replicas=watch.resizes.replicas(cfg.fault_tolerance.replica_groups, result)
        )
    if watch.recorder:
        watch.recorder.record_resizes(fields["resizes"])
        fields.update(watch.recorder.finish(fields["status"], fields["checkpoint"], run.register))
    session.close(fields["status"], fields["error"])
    if ended.bad_input is not None:
        # Bad input, as a ConfigError found before the start is: its one line and exit 2 (raylane.cli),
        # no summary; the MLflow run, opened already, is closed FAILED with the line as its tag.
        raise ended.bad_input
    summary = TrainSummary.model_validate(fields)
    record_finished(session.folder, summary)
    summary.write(run.summary_path)
    _print_outcome(summary, ui_command(run.tracking_uri, watch.handle), failed_ranks)
    return summary


def _summary(
    cfg: BaseConfig,
    handle: Any,
    status: Status,
    error: str | None,
    result: RunResult | None,
    display: ProgressDisplay,
    launched: float,
    startup: Any,
) -> dict[str, Any]:
    """The fields of the run's TrainSummary (raylane.results describes each); a run that failed
    has no result, and the summary's defaults stand for its figures."""
    from raylane.loop.data import baddata
    from raylane.tracking.observe import memory_snapshots, profile_traces

    first = display.first_step_unix
    return {
        "world_size": cfg.scaling.num_workers,
        **(_result_fields(result) if result is not None else {}),
        "status": status,
        "error": error,
        "run_name": cfg.run.name,
        "run_id": handle.run_id if handle else None,
        "tracking_uri": handle.tracking_uri if handle else None,
        "experiment": cfg.mlflow.experiment,
        # A run that failed has no result: its newest valid checkpoint is on storage (an async save
        # committed after the last one the display heard of, or one of an earlier launch).
        "checkpoint": (result.checkpoint if result else None)
        or _newest_checkpoint(cfg)
        or (display.checkpoints[-1].location if display.checkpoints else None),
        "skipped_checkpoints": display.skipped_checkpoints,
        "profile_traces": profile_traces(cfg),  # every profiled rank's, in the run's folder
        "memory_snapshots": memory_snapshots(cfg),
        "wall_s": round(time.time() - launched, 3),
        # Every (re)start of the worker group announces itself; the first one is not a restart.
        "restarts": max(display.starts - 1, 0),
        # Counted where the rows were counted: by this process (the Ray driver's counting pass,
        # torchrun's rank 0), or by rank 0 on Ray (a dataset tokenized at once, a rank's reader).
        "skipped_rows": {**(result.skipped_rows if result else {}), **baddata.skipped_rows()},
        "timing": {
            "launched_unix": launched,
            "first_step_unix": first,
            "last_step_unix": display.end_unix,
            "launch_to_first_step_s": round(first - launched, 3) if first else None,
            "restart_first_step_unix": display.first_steps_unix[1:],
            "startup": startup.seconds(),
            "startup_origin_unix": startup.unix.get("launch"),
            "warm_actors": _warm_actors(startup),
        },
    }


def _warm_actors(startup: Any) -> dict[str, bool]:
    """Which actors started on warm workers (raylane.onray.warm), said in one line as well where
    the run joined a warm pool (where none started warm, its start-up line said why). Elsewhere
    an actor may still land on a worker Ray itself started idle, unpreloaded: recorded, unsaid."""
    warm = startup.warm_actors()
    if warm and _joined_a_warm_pool():
        log.info("%d of %d actors started on warm workers", sum(warm.values()), len(warm))
    return warm


def _joined_a_warm_pool() -> bool:
    from raylane.onray import warm  # no Ray: the head's record and its processes (psutil)

    return warm.joined_pool() is not None


def _result_fields(r: RunResult) -> dict[str, Any]:
    """The summary's fields the run's result gives, by attribute."""
    return {
        "world_size": r.world_size,
        "backend": r.backend,
        "epochs": r.epochs,
        "partial_epoch": r.partial_epoch,
        "steps": r.steps,
        "steps_per_epoch": r.steps_per_epoch,
        "resumed_from_step": r.resumed_from_step,
        "metrics": r.metrics,
        "last_window": r.last_window,
        "samples_per_s": r.samples_per_s,
        "tokens_per_s": r.tokens_per_s,
        "real_tokens_per_s": r.real_tokens_per_s,
        "packing_efficiency": r.packing_efficiency,
        "mfu": r.mfu,
        "train_s": r.train_s,
        "train_cpu_s": r.train_cpu_s,
        "checkpoint_stall_s": r.checkpoint_stall_s,
        "epoch_end_s": r.epoch_end_s,
        "memory": r.memory,
        "strategy": r.strategy,
        "mesh": r.mesh,
        "node_ranks": r.node_ranks,
        "skipped_steps": r.skipped_steps,
        "failed_checkpoints": r.failed_checkpoints,
        "preempted": r.preempted,
        "stop_reason": r.stop_reason,
        "early_stopped": r.early_stopped,
        "tracking_cost_s": r.tracking_cost_s,
        "stragglers": r.stragglers or [],
        "experts": r.experts,
    }


def _newest_checkpoint(cfg: BaseConfig) -> str | None:
    """The run's newest checkpoint whose files have its manifest's sizes (the name for the
    summary: a relaunch checks their checksums too, which would mean reading, or downloading,
    the whole checkpoint here)."""
    import pyarrow.fs as pafs

    from raylane.loop.checkpoint.manifest import newest_valid

    storage = cfg.run.storage_path
    try:
        fs, root = pafs.FileSystem.from_uri(storage) if "://" in storage else (pafs.LocalFileSystem(), storage)
        path = newest_valid(f"{root.rstrip('/')}/{cfg.run.name}", fs, checksums=False)[0]
    except (OSError, ValueError) as exc:
        log.warning("could not look for run %s's checkpoints in %s: %s", cfg.run.name, storage, exc)
        return None
    return path if path is None or isinstance(fs, pafs.LocalFileSystem) else f"{fs.type_name}://{path}"


def _print_outcome(summary: TrainSummary, ui: str, failed_ranks: list[Any]) -> None:
    from raylane.logs import log_file
    from raylane.tracking.progress import outcome_text

    # The failed ranks' own logs (their whole tracebacks are in this one too), where torchrun's
    # ranks write them: on their hosts.
    ranks = [
        f"  {f'rank {f.rank} log:':<{LABEL_WIDTH}}{f.log}"
        + (f" (on {f.host})" if f.host != socket.gethostname() else "")
        for f in failed_ranks
        if f.log
    ]
    print("\n".join([outcome_text(summary, ui, log_file()), *ranks]), flush=True)


def finalize_run(
    cfg: BaseConfig, session: RunSession, is_driver: bool, folder: Path | None | Literal["find"] = FIND
) -> BaseConfig:
    """Fill what the driver decides, the run name (agreed by all torchrun ranks), and take the
    run's lease into `session`: ConfigError, on every rank, when another launch holds it. The
    run's folder is `session.folder` from here on: `folder`, the one the launch found for the name
    the config gives (raylane.api.prepare_train), else found here once the name is known (the driver's, and
    on the other torchrun ranks the one they agreed on)."""
    named = cfg.run.name is not None
    cfg = cfg.with_run_name()
    found: Path | None = None if isinstance(folder, str) else folder
    known = named and not isinstance(folder, str)  # found by the launch for the name the config gives
    error = None
    if is_driver:
        found = found if known else run_folder(cfg)
        # A name the user gave, found nowhere here: most likely a relaunch from another folder
        # (outputs are relative to the working directory). A generated name is always new.
        if named and (line := fresh_start(cfg, found)):
            log.info("%s", line)
        try:
            name = str(cfg.run.name)  # with_run_name named it
            session.lease(found, f"run {name!r}", "run.name", name, lambda: fresh_name(cfg))
        except ConfigError as exc:
            error = str(exc)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        agreed = [cfg.run.name, error]
        dist.broadcast_object_list(agreed, src=0)  # rank 0's generated name wins
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": agreed[0]})})
        error = agreed[1]
    if not (is_driver or known):
        found = run_folder(cfg)  # the agreed name's
    session.folder = found
    if error:
        raise ConfigError(error)
    storage = cfg.run.storage_path
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"storage_path": storage})})
