"""The driver's side of a run, whichever launcher runs the ranks: name the run, open its MLflow
run, show progress, close the run with the right status and write the summary."""

from __future__ import annotations

import importlib
import logging
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from raylane.config import BaseConfig, ConfigError
from raylane.loop.events import Event
from raylane.prechecks import closing_status, fresh_name, fresh_start, record_finished, run_folder
from raylane.results import Status, TrainSummary
from raylane.tracking.progress import ProgressDisplay

log = logging.getLogger("raylane")


def finalize_run(cfg: BaseConfig, stack: ExitStack, is_driver: bool) -> BaseConfig:
    """Fill what the driver decides, the run name (agreed by all torchrun ranks), and take the
    run's lease (raylane.lease): ConfigError, on every rank, when another launch holds it."""
    named = cfg.run.name is not None
    cfg = cfg.with_run_name()
    error = None
    if is_driver:
        # A name the user gave, found nowhere here: most likely a relaunch from another folder
        # (outputs are relative to the working directory). A generated name is always new.
        if named and (line := fresh_start(cfg)):
            log.info("%s", line)
        try:
            _take_lease(cfg, stack)
        except ConfigError as exc:
            error = str(exc)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        agreed = [cfg.run.name, error]
        dist.broadcast_object_list(agreed, src=0)  # rank 0's generated name wins
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": agreed[0]})})
        error = agreed[1]
    if error:
        raise ConfigError(error)
    storage = cfg.run.storage_path
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"storage_path": storage})})


def _take_lease(cfg: BaseConfig, stack: ExitStack) -> None:
    """One writer per run: held until the driver is done (every way out gives it back)."""
    from raylane.lease import acquire

    folder = run_folder(cfg)
    if folder is not None:
        lease = acquire(folder, f"run {cfg.run.name!r}", "run.name", cfg.run.name, lambda: fresh_name(cfg))
        stack.callback(lease.release)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _torchrun_rank_done(stack: ExitStack, world_size: int, stopped: bool) -> None:
    """Training is over on this torchrun rank. Only after a graceful stop do the ranks wait for
    each other before they leave (raylane.loop.distributed.leave_process_group): the end of a
    finished run is no collective, so rank 0's end-of-run records, however long, cannot turn it
    into a failure on another rank's timeout."""
    from raylane.loop.distributed import leave_process_group

    if world_size > 1:
        # When another rank failed, torchrun now SIGTERMs the survivors (and SIGKILLs them 30 s
        # later): rank 0 still has to close the MLflow run and write the summary, so it finishes
        # that first. Ctrl-C still interrupts.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stack.callback(leave_process_group, wait_for_peers=stopped)  # runs last: after rank 0's summary


def train(
    cfg: BaseConfig,
    *,
    use_ray: bool,
    address: str | None = None,
    summary_path: str | None = None,
    register: str | None = None,
) -> TrainSummary:
    """Run training to the end; returns the summary (on a torchrun rank other than 0, only its
    `status` and `error`), whose `exit_code` is the command's."""
    from raylane.loop import baddata, preemption
    from raylane.loop.distributed import env_ranks, init_process_group
    from raylane.loop.startup import StartupTimes
    from raylane.tracking.records import RunRecorder
    from raylane.tracking.resizes import Resizes
    from raylane.tracking.runs import open_run, resolve_tracking_uri, ui_command

    launched = time.time()
    baddata.forget_skipped()  # a second raylane.train() in this process counts its own data
    startup = StartupTimes()
    startup.mark("driver_imports")
    signal.signal(signal.SIGTERM, _raise_interrupt)  # before training can stop gracefully: like Ctrl-C
    if not use_ray:
        init_process_group(cfg.scaling.use_gpu, cfg.dist.timeout_s)  # ranks agree on the run name first
        startup.mark("process_group")
    is_driver = use_ray or env_ranks()[0] == 0
    tracking_uri = resolve_tracking_uri()
    with ExitStack() as stack:
        cfg = finalize_run(cfg, stack, is_driver)
        # Opening the MLflow run (import + database) overlaps with starting Ray.
        pool = stack.enter_context(ThreadPoolExecutor(2, thread_name_prefix="raylane-start"))
        world_size = cfg.scaling.num_workers if use_ray else env_ranks()[2]
        tracked = is_driver and cfg.mlflow.enabled
        run_future = pool.submit(open_run, cfg, tracking_uri, world_size) if tracked else None
        closer = stack.enter_context(_RunCloser(cfg, run_future))
        try:
            ray_stopper, embedded = _start_ray(cfg, address, pool, stack, startup) if use_ray else (None, False)
        except BaseException as exc:  # noqa: BLE001 - each way out closes the MLflow run
            return _not_started(cfg, closer, exc)
        # From here on, a first SIGTERM or Ctrl-C asks the ranks to checkpoint and stop.
        preemption.install()
        handle = _opened(cfg, run_future, tracking_uri)
        if handle:
            startup.mark("tracking")
        display = ProgressDisplay() if is_driver else None
        recorder = RunRecorder(handle, cfg, prewarm=use_ray) if handle else None
        resizes = Resizes()
        listeners = [x.handle if x is display else x.on_event for x in (resizes, display, recorder) if x is not None]
        status, error, result = _execute(
            cfg, use_ray, embedded, handle, tracking_uri, [*listeners, startup.on_event], display
        )
        if use_ray:
            ray_stopper.start()  # the ranks are done; the records below need MLflow, not Ray
        else:
            _torchrun_rank_done(stack, world_size, stopped=bool(result.get("preempted")))
        if not is_driver:
            return TrainSummary(status=status, error=error, run_name=cfg.run.name)
        fields = _summary(cfg, handle, status, error, result, display, launched, startup)
        fields["resizes"] = resizes.resizes
        if recorder:
            recorder.record_resizes(resizes.resizes)
            fields.update(recorder.finish(status, fields["checkpoint"], register))
            closer.close(status)
        summary = TrainSummary.model_validate(fields)
        record_finished(cfg, summary)
        summary.write(summary_path)
        _print_outcome(summary, ui_command(tracking_uri, handle))
        return summary


def _start_ray(
    cfg: BaseConfig, address: str | None, pool: ThreadPoolExecutor, stack: ExitStack, startup: Any
) -> tuple[Any, bool]:
    """Join or start the cluster; returns (the RayStopper that `stack` calls last, whether this
    process started the cluster)."""
    from raylane.onray.localcluster import resolve_address

    address = resolve_address(address)  # before Ray's import: see resolve_address
    from raylane.onray.cluster import RayStopper, init_ray

    # Ray Train and torch import (~3.5 s of CPU on 2 cores) while Ray's processes start:
    # ray.init mostly waits for them. launch_on_ray's import below joins this one.
    pool.submit(importlib.import_module, "raylane.onray.launch")
    embedded = init_ray(address, cfg)
    startup.mark("ray_init")
    ray_stopper = RayStopper(embedded)
    stack.callback(ray_stopper.wait)  # last: after the summary is out
    signal.signal(signal.SIGTERM, _raise_interrupt)  # ray.init replaced ours
    return ray_stopper, embedded


class _RunCloser:
    """This launch's MLflow run, closed exactly once on every way out: with the launch's status
    at its end, or KILLED or FAILED when a signal or an error cuts it short (while Ray starts, or
    while the end-of-run records, seconds of them, are written). A run still being opened is
    closed by the thread opening it, once it is open, so that a second signal cannot keep it
    from being closed."""

    def __init__(self, cfg: BaseConfig, run_future: Any) -> None:
        self.cfg, self.future, self.closed = cfg, run_future, False

    def close(self, status: str) -> None:
        if self.closed or self.future is None:
            return
        from raylane.tracking.runs import close_run

        self.closed = True
        final = closing_status(self.cfg, status)
        self.future.add_done_callback(lambda f: f.exception() is None and close_run(f.result(), final))

    def __enter__(self) -> _RunCloser:  # noqa: PYI034 - a private class, never subclassed
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: object, tb: object) -> bool:
        if kind is not None:
            self.close(Status.FAILED if issubclass(kind, Exception) else Status.KILLED)
        return False


def _not_started(cfg: BaseConfig, closer: _RunCloser, exc: BaseException) -> TrainSummary:
    """Ray could not be started or joined, or a signal came while the launch waited for it. An
    interrupt ends the launch KILLED, as one during training does; anything else is raised again
    (FAILED)."""
    interrupted = not isinstance(exc, Exception)  # KeyboardInterrupt (SIGTERM too), or Ray's SystemExit
    closer.close(Status.KILLED if interrupted else Status.FAILED)
    if not interrupted:
        raise exc
    print("raylane: interrupted while waiting for the Ray cluster; nothing was trained", file=sys.stderr, flush=True)
    return TrainSummary(status=Status.KILLED, error="interrupted before training started", run_name=cfg.run.name)


def _opened(cfg: BaseConfig, run_future: Any, tracking_uri: str) -> Any:
    """The MLflow run, or None (with a warning) when the tracking server cannot be reached:
    training does not wait for tracking."""
    if run_future is None:
        return None
    try:
        handle = run_future.result()
    except Exception as exc:  # noqa: BLE001
        # MLflow's message runs to several hundred characters of retries and URLs: the cause is its errno's.
        errno = re.search(r"\[Errno -?\d+\] ([^\"')]+)", str(exc))
        cause = errno.group(1).strip() if errno else f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        log.warning("MLflow at %s cannot be reached (%s): training without tracking", tracking_uri, cause)
        return None
    log.info("run %s (MLflow run %s%s)", cfg.run.name, handle.run_id, ", continued" if handle.resumed else "")
    return handle


def _execute(
    cfg: BaseConfig,
    use_ray: bool,
    embedded: bool,
    handle: Any,
    tracking_uri: str,
    listeners: list[Callable[[Event], None]],
    display: ProgressDisplay | None,
) -> tuple[Status, str | None, dict[str, Any]]:
    """Run the ranks, passing rank 0's events to `listeners`; returns (MLflow status, error
    message, result)."""
    run_id = handle.run_id if handle else None

    def on_event(event: Event) -> None:
        for listener in listeners:
            listener(event)

    from raylane.loop import preemption

    try:
        with preemption.armed():
            if use_ray:
                from raylane.onray.launch import launch_on_ray

                result = launch_on_ray(cfg, run_id, tracking_uri, on_event, embedded=embedded)
            else:
                from raylane.loop.distributed import env_ranks
                from raylane.loop.run import launch_local
                from raylane.tracking.runs import rank_zero_logger

                logger = rank_zero_logger(cfg, tracking_uri, run_id) if run_id and env_ranks()[0] == 0 else None
                result = launch_local(cfg, on_event, logger)
        if result.get("preempted"):
            return (
                Status.KILLED,
                (
                    f"stopped at step {result['steps']} ({result.get('stop_reason')}); "
                    f"checkpoint saved: relaunch with run.name={cfg.run.name} to resume"
                ),
                result,
            )
        return Status.FINISHED, None, result
    except KeyboardInterrupt:
        return Status.KILLED, "interrupted", {}
    except Exception as exc:  # the launcher's message names the rank and its exception
        return Status.FAILED, _failure_text(exc), {}
    finally:
        if display:
            display.close()


def _failure_text(exc: Exception) -> str:
    """The one line a failed run's summary shows; the whole traceback goes to the library log
    (on Ray, the ranks' tracebacks were logged as they arrived: raylane.onray.launch)."""
    from raylane.errors import DataError, TrainingError
    from raylane.logs import record_traceback
    from raylane.pipelines_ref import UserCodeError

    if isinstance(exc, TrainingError):
        return str(exc)
    record_traceback("the run failed:", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    if isinstance(exc, (UserCodeError, DataError)):  # complete as they are: the function or data, and the place
        return str(exc)
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0]}" + (" (the rest in the library log)" if len(lines) > 1 else "")


def _summary(
    cfg: BaseConfig,
    handle: Any,
    status: Status,
    error: str | None,
    result: dict[str, Any],
    display: ProgressDisplay,
    launched: float,
    startup: Any,
) -> dict[str, Any]:
    """The fields of the run's TrainSummary (raylane.results describes each)."""
    from raylane.loop import baddata

    first = display.first_step_unix
    copied = (
        "world_size",
        "backend",
        "epochs",
        "partial_epoch",
        "steps",
        "samples_per_s",
        "train_s",
        "train_cpu_s",
        "checkpoint_stall_s",
        "epoch_end_s",
        "tokens_per_s",
        "mfu",
        "memory",
        "strategy",
        "mesh",
        "node_ranks",
        "last_window",
        "steps_per_epoch",
        "resumed_from_step",
        "stop_reason",
        "tracking_cost_s",
    )
    return {
        **{key: result.get(key) for key in copied},
        "world_size": result.get("world_size", cfg.scaling.num_workers),
        "status": status,
        "error": error,
        "run_name": cfg.run.name,
        "run_id": handle.run_id if handle else None,
        "tracking_uri": handle.tracking_uri if handle else None,
        "experiment": cfg.mlflow.experiment,
        # A run that failed has no result: its newest valid checkpoint is on storage (an async save
        # committed after the last one the display heard of, or one of an earlier launch).
        "checkpoint": result.get("checkpoint")
        or _newest_checkpoint(cfg)
        or (display.checkpoints[-1].location if display.checkpoints else None),
        "skipped_checkpoints": display.skipped_checkpoints,
        "wall_s": round(time.time() - launched, 3),
        "metrics": result.get("metrics", {}),
        # Every (re)start of the worker group announces itself; the first one is not a restart.
        "restarts": max(display.starts - 1, 0),
        "skipped_steps": result.get("skipped_steps", 0),
        # Counted where the rows were counted: by this process (the Ray driver's counting pass,
        # torchrun's rank 0), or by rank 0 on Ray (a dataset tokenized at once, a rank's reader).
        "skipped_rows": {**result.get("skipped_rows", {}), **baddata.skipped_rows()},
        "failed_checkpoints": result.get("failed_checkpoints", 0),
        "preempted": bool(result.get("preempted")),
        "early_stopped": bool(result.get("early_stopped")),
        "timing": {
            "launched_unix": launched,
            "first_step_unix": first,
            "last_step_unix": display.end_unix,
            "launch_to_first_step_s": round(first - launched, 3) if first else None,
            "restart_first_step_unix": display.first_steps_unix[1:],
            "startup": startup.seconds(),
            "startup_origin_unix": startup.unix.get("launch"),
        },
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


def _print_outcome(summary: TrainSummary, ui: str) -> None:
    from raylane.logs import log_file
    from raylane.tracking.progress import outcome_text

    print(outcome_text(summary, ui, log_file()), flush=True)
