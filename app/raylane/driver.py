"""The driver's side of a run, whichever launcher runs the ranks: name the run, open its MLflow
run, show progress, close the run with the right status and write the summary. The lifecycle
(lease, MLflow run, status, interrupts) is raylane.session's, as for every launch."""

from __future__ import annotations

import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raylane.config import BaseConfig
from raylane.config.batching import HeldBatch
from raylane.errors import TrainingError
from raylane.loop.protocols.events import Event
from raylane.loop.protocols.result import RunResult
from raylane.pipelines_ref import Resolved
from raylane.results import Status, TrainSummary
from raylane.runrecord import record_finished
from raylane.session import (
    RunSession,
    failure_text,
    finalize_run,
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
    once (raylane.prepare.PreparedRun); `address`: the cluster a Ray run joins, as they resolved it."""
    from raylane.loop import preemption
    from raylane.loop.data import baddata
    from raylane.loop.distributed.groups import env_ranks
    from raylane.loop.observe.startup import StartupTimes
    from raylane.tracking.health import stop_watch
    from raylane.tracking.runs import open_run, resolve_tracking_uri, ui_command

    launched = time.time()
    startup = StartupTimes()
    if not use_ray:
        from raylane.loop.run import prelude  # the loop this process runs: its imports are the driver's
    baddata.forget_skipped()  # a second raylane.train() in this process counts its own data
    startup.mark("driver_imports")
    signal.signal(signal.SIGTERM, raise_interrupt)  # before training can stop gracefully: like Ctrl-C
    if not use_ray:
        prelude(cfg, folder)  # env:, NCCL's flight recorder, the process group: the ranks agree on the run name first
        startup.mark("process_group")
    is_driver = use_ray or env_ranks()[0] == 0  # on Ray, or torchrun's rank 0
    tracking_uri = resolve_tracking_uri()
    with RunSession() as session:
        cfg = finalize_run(cfg, session, is_driver, folder)
        session.closes_as_run(cfg)
        # Opening the MLflow run (import + database) overlaps with starting Ray.
        pool = session.enter(ThreadPoolExecutor(2, thread_name_prefix="raylane-start"))
        world_size = cfg.scaling.num_workers if use_ray else env_ranks()[2]
        if is_driver and cfg.mlflow.enabled:
            session.open_on(pool, open_run, cfg, tracking_uri, world_size, session.folder)
        try:
            ray_stopper = None
            if use_ray:  # Ray's imports take turns with the MLflow opener's on the pool (session.HEAVY_IMPORTS)
                import_exclusively("raylane.onray.cluster", "raylane.onray.launch")
                from raylane.onray.cluster import start_ray

                ray_stopper = start_ray(cfg, address, pool, startup)
                session.defer(ray_stopper.wait)  # last, after the summary is out
        except BaseException as exc:  # noqa: BLE001 - each way out closes the MLflow run
            not_started(session, exc)  # raised again unless an interrupt
            return TrainSummary(status=status_of(exc), error=NOT_STARTED, run_name=cfg.run.name)
        # From here on, a first SIGTERM or Ctrl-C asks the ranks to checkpoint and stop.
        preemption.install()
        ending = None if use_ray or world_size < 2 else TorchrunEnding(env_ranks()[0])
        handle = session.handle()  # None: MLflow is off, or its server cannot be reached
        display, recorder, resizes, listeners, health = _watchers(cfg, handle, is_driver, use_ray, startup)
        embedded = bool(ray_stopper and ray_stopper.embedded)
        launch = Launch(use_ray, embedded, session.folder, pipeline, handle, tracking_uri, held)
        status, error, result = _execute(cfg, launch, listeners, display, ending)
        stop_watch(health)  # the nodes' last samples logged; a node silent at the end is not named
        if ray_stopper:
            ray_stopper.start()  # the ranks are done; the records below need MLflow, not Ray
        else:
            _torchrun_rank_done(session, world_size, stopped=bool(result and result.preempted))
        if not is_driver:
            return TrainSummary(status=status, error=error, run_name=cfg.run.name)
        fields = _summary(cfg, handle, status, error, result, display, launched, startup)
        fields.update(world_size=result.world_size if result else world_size, resizes=resizes.resizes)
        ui = ui_command(tracking_uri, handle)
        return _finish(cfg, session, recorder, fields, register, summary_path, ui, ending.said if ending else [])


def _watchers(cfg: BaseConfig, handle: Any, is_driver: bool, use_ray: bool, startup: Any) -> tuple[Any, ...]:
    """What hears rank 0's events on the driver: (progress display, MLflow recorder, resizes,
    the listeners in their order, the nodes' health watch); the display and the recorder are
    None where there is none (a torchrun rank other than 0; MLflow off or unreachable: training
    does not wait for tracking)."""
    from raylane.tracking.health import start_watch
    from raylane.tracking.records import RunRecorder
    from raylane.tracking.resizes import Resizes

    if handle:
        startup.mark("tracking")
        log.info("run %s (MLflow run %s%s)", cfg.run.name, handle.run_id, ", continued" if handle.resumed else "")
    display = ProgressDisplay() if is_driver else None
    recorder = RunRecorder(handle, cfg, prewarm=use_ray) if handle else None
    resizes = Resizes()
    listeners = [x.handle if x is display else x.on_event for x in (resizes, display, recorder) if x is not None]
    health = start_watch(cfg, handle.tracking_uri, handle.run_id) if handle else None
    return display, recorder, resizes, [*listeners, startup.on_event], health


def _finish(
    cfg: BaseConfig,
    session: RunSession,
    recorder: Any,
    fields: dict[str, Any],
    register: str | None,
    summary_path: str | None,
    ui: str,
    failed_ranks: list[Any],
) -> TrainSummary:
    """The end-of-run records, the MLflow run's close (with the error line as a tag), the run's
    record and the summary; `failed_ranks`: under torchrun, the other ranks whose failure the
    error names (raylane.loop.observe.rankfailures.RankFailure), whose logs are named below it."""
    if recorder:
        recorder.record_resizes(fields["resizes"])
        fields.update(recorder.finish(fields["status"], fields["checkpoint"], register))
    session.close(fields["status"], fields["error"])
    summary = TrainSummary.model_validate(fields)
    record_finished(session.folder, summary)
    summary.write(summary_path)
    _print_outcome(summary, ui, failed_ranks)
    return summary


@dataclass(frozen=True)
class Launch:
    """How `_execute` runs the ranks: on Ray (on a cluster this process started: `embedded`) or
    here, with the run's folder and pipeline, and the MLflow run rank 0 logs to (`handle`)."""

    use_ray: bool
    embedded: bool
    folder: Path | None
    pipeline: Resolved
    handle: Any
    tracking_uri: str
    held: HeldBatch | None = None  # the global batch held on the planned world (raylane.prepare)


def _execute(
    cfg: BaseConfig,
    launch: Launch,
    listeners: list[Callable[[Event], None]],
    display: ProgressDisplay | None,
    ending: TorchrunEnding | None = None,
) -> tuple[Status, str | None, RunResult | None]:
    """Run the ranks, passing rank 0's events to `listeners`; returns (MLflow status, error
    message, result: None when the run failed). `ending`: a torchrun rank's, of several."""
    tracking_uri, handle = launch.tracking_uri, launch.handle
    run_id = handle.run_id if handle else None

    def on_event(event: Event) -> None:
        for listener in listeners:
            listener(event)

    from raylane.loop import preemption

    try:
        with preemption.armed():
            if launch.use_ray:
                from raylane.onray.launch import launch_on_ray, train_worker

                ended = launch_on_ray(
                    cfg,
                    run_id,
                    tracking_uri,
                    on_event,
                    embedded=launch.embedded,
                    worker=train_worker,
                    folder=launch.folder,
                    pipeline=launch.pipeline,
                    held=launch.held,
                )
                result = ended if isinstance(ended, RunResult) else None  # None: no End came
            else:
                from raylane.loop.distributed.groups import env_ranks
                from raylane.loop.run import launch_local
                from raylane.tracking.runs import rank_zero_logger

                logger = None
                if run_id and env_ranks()[0] == 0:
                    logger = rank_zero_logger(cfg, tracking_uri, run_id, launch.folder)
                result = launch_local(cfg, on_event, logger, launch.held)
        status = ran(bool(result is not None and result.preempted))
        if result is not None and status == Status.KILLED:
            return (
                status,
                (
                    f"stopped at step {result.steps} ({result.stop_reason}); "
                    f"checkpoint saved: relaunch with run.name={cfg.run.name} to resume"
                ),
                result,
            )
        return status, None, result
    except (KeyboardInterrupt, Exception) as exc:  # the launcher's message names the rank and its exception
        return (*(ending.ended(exc) if ending else outcome(exc)), None)
    finally:
        if ending:
            ending.over = True
        if display:
            display.close()


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


class TorchrunEnding:
    """How one torchrun rank's run ends when a rank fails (one of several ranks; the design:
    docs/reliability.md, "A rank's failure under torchrun"). A rank whose own error ended its run
    records it for rank 0 (raylane.loop.observe.rankfailures.publish); rank 0, whose run ended in an echo
    of another rank's failure (a peer gone) or in torchrun's SIGTERM, says the first recorded error
    instead, FAILED, with the failed ranks' logs. Installed, it holds SIGTERM: once a rank failed,
    torchrun's SIGTERM is no stop request (no checkpoint can be agreed with a rank gone) and, once
    the run's end is decided (`over`), not an interrupt either: rank 0 closes its MLflow run and
    writes the summary within torchrun's 30 s before SIGKILL."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.over = False
        self.said: list[Any] = []  # rank 0: the other ranks' RankFailures its line names
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        from raylane.loop.observe import rankfailures

        if self.over:
            return
        if not rankfailures.recorded():  # a stop asked by a person or a scheduler: as before
            previous = self._previous
            (previous if callable(previous) else raise_interrupt)(signum, frame)
            return
        if isinstance(sys.exc_info()[1], Exception):
            return  # this rank's own failure is on its way out, and is said with the others'
        raise_interrupt(signum, frame)  # another rank failed: stop now, no checkpoint to agree on

    def ended(self, exc: BaseException) -> tuple[Status, str]:
        """(status, error line) of a run that `exc`, an error or an interrupt, ended on this rank."""
        return (status_of(exc), self.failed(exc)) if isinstance(exc, Exception) else self.interrupted(exc)

    def failed(self, exc: Exception) -> str:
        """The error line of a run that `exc` ended on this rank."""
        from raylane.logs import log_file
        from raylane.loop.observe import rankfailures
        from raylane.loop.usercode import TRACEBACK_ATTR

        self.over = True
        line = failure_text(exc)  # this rank's traceback into its library log
        echo = rankfailures.is_echo(exc)
        if self.rank != 0:
            if not echo:
                text = getattr(exc, TRACEBACK_ATTR, None) or "".join(_format_exception(exc))
                rankfailures.publish(self.rank, line, text, str(log_file() or "") or None)
            return line
        return (self._others() or line) if echo else line

    def interrupted(self, exc: BaseException) -> tuple[Status, str]:
        """(status, error line) of a run that a signal ended on this rank: FAILED with this rank's
        own error when the signal cut its way out short, or with another rank's (torchrun's SIGTERM
        after that rank failed); else KILLED, interrupted."""
        self.over = True
        context = exc.__context__
        while context is not None and not isinstance(context, Exception):
            context = context.__context__
        if context is not None:
            return status_of(context), self.failed(context)
        if self.rank == 0 and (line := self._others()):
            return outcome(TrainingError(line))  # another rank's failure, as the Ray launcher says one
        return outcome(exc)

    def _others(self) -> str | None:
        """Rank 0: the other ranks' recorded failures in one line (their tracebacks into this
        rank's library log, as a Ray driver's has them), or None when none is recorded."""
        from raylane.logs import record_traceback
        from raylane.loop.observe import rankfailures

        failures = [f for f in rankfailures.recorded(rankfailures.READ_WAIT_S) if f.rank != self.rank]
        if not failures:
            return None
        self.said = rankfailures.said(failures)
        for f in self.said:
            record_traceback(f"training failed on rank {f.rank} ({f.host}):", f.traceback or f.line)
        return rankfailures.first_line(failures)


def _format_exception(exc: BaseException) -> list[str]:
    import traceback

    return traceback.format_exception(type(exc), exc, exc.__traceback__)
