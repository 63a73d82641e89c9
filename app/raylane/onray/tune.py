"""`raylane tune SWEEP.yaml`: Ray Tune sweeps whose trials are multi-worker Ray Train runs, each
recorded as a nested MLflow run under one parent run per sweep.

Ray 2.60's Train V2 no longer runs `Tuner(trainer)`: every trial is a small driver function
(`_trial`) that builds its own `TorchTrainer` (through `raylane.onray.launch.launch_on_ray`, as `raylane
train` does) and forwards rank 0's epoch-end results to Tune with a checkpoint that points at
raylane's own checkpoint, which is what ASHA stops on and what PBT copies between trials. The
MLflow child runs are opened by the trials; each is closed by one writer: the trial, after its
records, when its run returns or fails; this driver (`TrialRuns`, in `raylane.onray.trials`) when
Tune stops the trial while it runs, once its ranks have stopped at their next step boundary, so a
trial stopped early is never left RUNNING, nor trains on. On SIGTERM or Ctrl-C the driver stops
every running trial the same way, then Ray, and closes every run of the sweep KILLED
(`TrialRuns.interrupted`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import ray
from ray import tune

from raylane import logs
from raylane.config import BaseConfig, ConfigError, validate
from raylane.config.sweep import SweepSection, trial_config
from raylane.loop.protocols.events import Checkpoint, Event
from raylane.loop.protocols.result import RunResult
from raylane.onray.cluster import RayStopper, data_cpus
from raylane.onray.placement import put_env
from raylane.onray.sweep_plan import param_space, search_alg, trials_text
from raylane.onray.trials import (
    MetricReported,
    TrialRuns,
    sink_name,
    stop_on_interrupt,
    stopping_flag,
    sweep_stopping,
)
from raylane.results import Status, SweepSummary
from raylane.runrecord import run_folder
from raylane.session import RunSession, interrupts, ran, status_of
from raylane.sweeps import results as sweep_results
from raylane.sweeps.objective import Objective
from raylane.sweeps.record import fresh_sweep_name, resolved, sweep_folder, write_record
from raylane.sweeps.runs import open_parent, record_values, trial_run
from raylane.tracking.progress import plural
from raylane.tracking.runs import RunHandle, close_run, mlflow_client, resolve_tracking_uri, ui_command

log = logging.getLogger("raylane")

POINTER_FILE = "raylane_checkpoint.json"
# The trial function only waits on its Train run; Tune needs it to ask for some resource.
TRIAL_DRIVER_CPU = 0.01


# -- search space, algorithm, scheduler ---------------------------------------------------------


def _mutations(sweep: SweepSection) -> dict[str, Any]:
    """PBT's explore: resample from the range, or pick from the listed values."""
    space = param_space(sweep)
    return {
        k: list(next(iter(d.values()))) if next(iter(d)) in ("choice", "grid") else space[k]
        for k, d in sweep.space.items()
    }


def _scheduler(sweep: SweepSection, base: BaseConfig):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    if sweep.scheduler == "asha":
        return ASHAScheduler(
            time_attr="epoch",
            metric=sweep.metric,
            mode=sweep.mode,
            max_t=base.train.epoch_limit,
            grace_period=sweep.grace_period,
            reduction_factor=sweep.reduction_factor,
        )
    if sweep.scheduler == "pbt":
        return PopulationBasedTraining(
            time_attr="epoch",
            metric=sweep.metric,
            mode=sweep.mode,
            perturbation_interval=sweep.perturbation_interval,
            synch=sweep.pbt_synchronous,
            hyperparam_mutations=_mutations(sweep),
        )
    return FIFOScheduler()


# -- resources -------------------------------------------------------------------------------


def trial_resources(base: BaseConfig) -> dict[str, float]:
    s = base.scaling
    need = {"CPU": s.num_workers * s.cpus_per_worker + TRIAL_DRIVER_CPU + data_cpus(base)}
    if s.use_gpu:
        need["GPU"] = s.num_workers * s.gpus_per_worker
    need.update({name: s.num_workers * amount for name, amount in s.resources_per_worker.items()})
    return need


def check_resources(base: BaseConfig, sweep: SweepSection, total: dict[str, float], embedded: bool) -> int:
    """Concurrency the cluster holds; a clear error instead of trials pending forever."""
    need = trial_resources(base)
    fits = min(math.floor(total.get(k, 0) / v + 1e-9) for k, v in need.items())
    if fits < 1:
        have = ", ".join(f"{k} {total.get(k, 0):g}" for k in need)
        text = (
            f"scaling.num_workers = {base.scaling.num_workers}: one trial needs "
            f"{', '.join(f'{k} {v:g}' for k, v in need.items())}, the cluster has {have}"
        )
        if embedded:
            raise ConfigError(text + " (lower scaling.num_workers or scaling.cpus_per_worker)")
        print(f"[raylane] note: {text}; trials wait for the autoscaler to add nodes", flush=True)
        fits = 1
    return min(fits, sweep.max_concurrent_trials or fits)


# -- the trial ---------------------------------------------------------------------------------


def _restored_pointer() -> dict[str, Any] | None:
    ckpt = tune.get_checkpoint()
    if ckpt is None:
        return None
    with ckpt.as_directory() as d:
        return json.loads((Path(d) / POINTER_FILE).read_text())


def _trial_run_config(sweep: SweepSection, cfg: BaseConfig, own: str) -> tuple[BaseConfig, dict[str, Any] | None]:
    """The trial's run: its own (resumed when the trial restarts), or under a PBT exploit a new run
    that starts from the donor's checkpoint; returns (config, donor pointer or None)."""
    pointer, name, donor = _restored_pointer(), own, None
    if pointer and pointer["run_name"].startswith(own):
        name = pointer["run_name"]  # this trial's own run, restarted: resume it
    elif pointer:  # PBT exploit: continue a better trial's state with this trial's new values
        name, donor = f"{own}-{uuid.uuid4().hex[:6]}", pointer
    ck = cfg.checkpoint
    if sweep.scheduler == "pbt":
        # PBT clones a trial from the checkpoint it recorded at a perturbation, often several
        # epochs old by then: retention must not delete what another trial may still start from.
        ck = ck.model_copy(update={"keep": None})
    if donor:
        ck = ck.model_copy(update={"init_from": donor["location"]})
    return cfg.model_copy(
        update={
            "run": cfg.run.model_copy(update={"name": name}),
            "checkpoint": ck,
            "mlflow": cfg.mlflow.model_copy(update={"log_model": False}),
        }
    ), donor


def _trial(params: dict[str, Any], context: dict[str, Any]) -> None:
    """One trial: a Ray Train run of the base config with `params`, reporting every epoch."""
    from raylane.onray.launch import launch_on_ray, train_worker

    # The next trial reuses this process once this function has returned, and Tune waits only 2 s
    # for that: a trial ASHA stopped takes longer to stop its worker group on a busy machine, and
    # the next trial failed ('Could not re-use actor'). Read by Tune at each reuse, in this process.
    os.environ.setdefault("TUNE_FUNCTION_THREAD_TIMEOUT_S", "300")
    sweep, base = SweepSection(**context["sweep"]), validate(context["base"])
    parent = RunHandle(**context["parent"])
    trial_id = tune.get_context().get_trial_id()
    cfg, donor = _trial_run_config(sweep, trial_config(base, params, sweep.global_batch), f"{sweep.name}-{trial_id}")
    client = mlflow_client(parent.tracking_uri)
    run_id = trial_run(client, parent, trial_id, sweep, cfg)
    record_values(client, run_id, params, donor)
    reports = _Reports(sweep, cfg, trial_id, run_id, donor)
    handle = RunHandle(run_id, parent.experiment_id, parent.tracking_uri, False)
    try:
        ended = launch_on_ray(
            cfg,
            run_id,
            parent.tracking_uri,
            reports.on_event,
            embedded=False,
            in_trial=True,
            worker=train_worker,
            env=context.get("env"),  # read by the sweep's driver: this trial may run on another node
            sink_name=sink_name(run_id),  # the sweep's driver stops a stopped trial's ranks through it
        )
    except SystemExit:
        # tune.report's way of saying Tune stopped this trial: the sweep's driver is the one writer
        # that closes its run, once its ranks have stopped (TrialRuns); nothing more is written here.
        raise
    except BaseException as exc:
        if not (isinstance(exc, Exception) and sweep_stopping(parent.run_id)):
            close_run(handle, status_of(exc))
        raise
    with RunSession() as session:  # the trial's child run, closed once its records are written
        session.track(handle)
        result = ended if isinstance(ended, RunResult) else None  # None: no End came
        if result is not None:  # the trial's whole-run throughput, named as a train run's (the runs table's column)
            for key, value in result.rates().items():
                client.log_metric(run_id, f"run/{key}", value, step=result.steps)
        session.close(ran(bool(result and result.preempted)))
    reports.last(result)


class _Reports:
    """What a trial tells Tune: its objective at each epoch end, with a checkpoint that points at
    raylane's own checkpoint (which ASHA stops on and PBT copies between trials)."""

    def __init__(
        self, sweep: SweepSection, cfg: BaseConfig, trial_id: str, run_id: str, donor: dict[str, Any] | None
    ) -> None:
        self.objective = Objective(sweep)
        self.cfg, self.trial_id, self.run_id, self.donor = cfg, trial_id, run_id, donor
        self.epoch: int = 0  # the last report's
        self.step: int | None = None

    def report(self, metrics: dict[str, float], epoch: int, step: int, location: str | None) -> None:
        self.epoch, self.step = epoch, step
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / POINTER_FILE).write_text(
                json.dumps(
                    {"location": location, "run_name": self.cfg.run.name, "trial_id": self.trial_id, "step": step}
                )
            )
            tune.report(
                {
                    **self.objective(metrics),
                    "epoch": epoch,
                    "step": step,
                    "checkpoint_location": location,
                    "run_id": self.run_id,
                    "exploited": bool(self.donor),
                },
                checkpoint=tune.Checkpoint.from_directory(d) if location else None,
            )

    def on_event(self, event: Event) -> None:
        # Tune sees epoch ends only: every trial reports at the same points. Not the last one,
        # reported once the run has returned (`last`): a scheduler's stop there (ASHA at max_t)
        # would tear the finished run down before its end-of-run records.
        if isinstance(event, Checkpoint) and event.metrics and event.epoch < self.cfg.train.epoch_limit:
            self.report({**event.speed, **event.metrics}, event.epoch, event.step, event.location)

    def last(self, result: RunResult | None) -> None:
        """The run's end, unless an epoch end reported it: the last epoch, or a max_steps stop."""
        if result is not None and result.metrics and self.step != result.steps:
            self.report({**result.speed(), **result.metrics}, result.epochs, result.steps, result.checkpoint)


# -- the driver --------------------------------------------------------------------------------


def run_sweep(
    sweep: SweepSection, base: BaseConfig, *, address: str | None, summary_path: str | None, register: str | None
) -> SweepSummary:
    """Run (or continue) the sweep on the cluster at `address` (as resolved by
    raylane.clusters.local.resolve_address; None: an embedded one); returns its summary, whose
    `status` is FINISHED when every trial ended cleanly and FAILED otherwise, KILLED on SIGTERM or
    Ctrl-C while the trials run (every run of the sweep closed KILLED: TrialRuns.interrupted).
    Every way out closes the sweep's MLflow parent run and gives its lease back (its session:
    raylane.session)."""
    from raylane.onray.cluster import start_ray

    tracking_uri = resolve_tracking_uri()
    base = resolved(base)
    with RunSession() as session:
        _lease(sweep, base, session)  # one writer per sweep: before its records or its MLflow run
        with interrupts():  # a joined cluster installs no handler of Ray's: ours, throughout
            parent = session.open(open_parent, sweep, base, tracking_uri)
            write_record(sweep, base, "RUNNING", parent_run_id=parent.run_id)
            per_trial = trial_resources(base)["CPU"]
            # A trial's workers must fit some node (accelerator, resources, labels): checked there.
            # Ray Train is imported by the trials, not here.
            ray_stop = start_ray(
                base, address, num_cpus=math.ceil(per_trial * (sweep.max_concurrent_trials or 2)), dashboard=True
            )
            if ray_stop.embedded:
                session.defer(ray_stop.wait)
            summary, rows, best = _sweep(sweep, base, session, parent, ray_stop, register)
    summary.write(summary_path)
    if summary.status == Status.KILLED:
        print(f"raylane: {summary.error}", file=sys.stderr, flush=True)
        return summary
    print(sweep_results.table(rows, sweep), flush=True)
    if best:
        print(
            f"best trial {best['trial_id']}: {sweep.metric} {best['metric']:.4f} (MLflow run {best['run_id']})",
            flush=True,
        )
    print(f"[raylane] MLflow UI: {ui_command(tracking_uri, parent)}", flush=True)
    return summary


def _sweep(
    sweep: SweepSection,
    base: BaseConfig,
    session: RunSession,
    parent: RunHandle,
    ray_stop: RayStopper,
    register: str | None,
) -> tuple[SweepSummary, list[dict[str, Any]], dict[str, Any] | None]:
    """The trials on the cluster Ray joined (`ray_stop` stops it, or leaves a joined one), and
    their results on the parent run: (summary, rows, best trial)."""
    embedded = ray_stop.embedded
    concurrency = check_resources(base, sweep, ray.cluster_resources(), embedded)
    print(
        f"[raylane] sweep {sweep.name}: {trials_text(sweep)}, {concurrency} at a time, "
        f"{plural(base.scaling.num_workers, 'worker')} per trial; MLflow parent run {parent.run_id}",
        flush=True,
    )
    random.seed(sweep.seed)  # PBT's explore draws from Python's generator
    started = time.monotonic()
    stopper = MetricReported(sweep.metric)
    trial_runs = TrialRuns(parent, sweep, base.train.epoch_limit, stopping_flag(parent.run_id))
    try:
        grid = _fit(sweep, base, parent, concurrency, stopper, trial_runs)
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C
        interrupted = stop_on_interrupt(sweep, parent, session, trial_runs, ray_stop)
        write_record(sweep, base, Status.KILLED, parent_run_id=parent.run_id)
        return interrupted, [], None
    stopper.check()
    wall_s = time.monotonic() - started
    rows = sweep_results.rows(grid, sweep, parent)
    best = sweep_results.best(grid, sweep, rows)
    trial_s = sum(r["time_s"] or 0 for r in rows)
    # The ideal: every trial's own time, perfectly packed `concurrency` at a time.
    status = Status.FAILED if grid.errors else Status.FINISHED
    failed = [r["trial_id"] for r in rows if r["error"]]
    summary = SweepSummary.model_validate(
        {
            "status": status,
            "parent_run_id": parent.run_id,
            "tracking_uri": parent.tracking_uri,
            "sweep": sweep.name,
            "error": f"{len(grid.errors)} of {len(rows)} trials failed ({', '.join(failed)})" if grid.errors else None,
            "best": best,
            "trials": rows,
            "concurrency": concurrency,
            "timing": {"wall_s": wall_s, "trial_s_sum": trial_s, "ideal_s": trial_s / concurrency},
            **sweep_results.record_parent(parent, sweep, rows, best, register),
        }
    )
    session.close(status)
    write_record(sweep, base, status, parent_run_id=parent.run_id, best=best, trials=len(rows))
    return summary, rows, best


def _lease(sweep: SweepSection, base: BaseConfig, session: RunSession) -> None:
    """The sweep folder's lease (raylane.lease), into `session`; ConfigError when another launch
    holds it. A sweep on object storage takes none."""
    folder = sweep_folder(sweep, base)
    if folder is not None:
        session.lease(folder, f"sweep {sweep.name!r}", "sweep.name", sweep.name, lambda: fresh_sweep_name(folder))


def _fit(
    sweep: SweepSection,
    base: BaseConfig,
    parent: RunHandle,
    concurrency: int,
    stopper: tune.Stopper,
    trial_runs: TrialRuns,
):
    context = {
        "sweep": sweep.model_dump(mode="json"),
        "base": base.model_dump(mode="json"),
        "parent": {
            "run_id": parent.run_id,
            "experiment_id": parent.experiment_id,
            "tracking_uri": parent.tracking_uri,
            "resumed": False,
        },
        # A reference: the trial's `params.json` and Tune's records never hold the values.
        "env": put_env(base, run_folder(base)),
    }
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    trainable = tune.with_resources(tune.with_parameters(_trial, context=context), {"CPU": TRIAL_DRIVER_CPU})
    # Tune's default loggers, less its TensorBoard one: tensorboardX imports torch into this
    # driver, ~2 s of CPU before the first trial starts (the sweep's metrics are in MLflow). Tune
    # adds all three unless told not to (_tune_environment), so the other two are named.
    run_config = tune.RunConfig(
        name=sweep.name,
        storage_path=base.run.storage_path,
        verbose=1 if logs.verbose() else 0,  # --verbose: Tune's status tables too
        callbacks=[trial_runs, CSVLoggerCallback(), JsonLoggerCallback()],
        stop=stopper,
        failure_config=tune.FailureConfig(max_failures=base.failure.max_failures),
    )
    tuner = _tuner(sweep, base, trainable, run_config, concurrency)
    try:
        with _tune_environment():
            grid = tuner.fit()
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C: the sweep's stop closes these runs, within its bound
        raise
    except BaseException:
        trial_runs.wait()
        raise
    trial_runs.wait()  # the stopped trials' runs closed before the results are read
    return grid


def _tuner(
    sweep: SweepSection, base: BaseConfig, trainable: Any, run_config: tune.RunConfig, concurrency: int
) -> tune.Tuner:
    """The sweep's Tuner: continued from Tune's records in the sweep's folder when an earlier
    launch of the sweep left them (its trials resumed, its unfinished and errored ones run again),
    else a new one with the sweep's search and scheduler and `run_config` (a restored Tuner has
    the run config its records hold)."""
    path = f"{base.run.storage_path.rstrip('/')}/{sweep.name}"
    if tune.Tuner.can_restore(path):
        print(f"[raylane] continuing sweep {sweep.name} from {path}", flush=True)
        return tune.Tuner.restore(
            path, trainable, resume_unfinished=True, resume_errored=True, param_space=param_space(sweep)
        )
    return tune.Tuner(
        trainable,
        param_space=param_space(sweep),
        run_config=run_config,
        tune_config=tune.TuneConfig(
            num_samples=sweep.num_samples,
            search_alg=search_alg(sweep, concurrency),
            scheduler=_scheduler(sweep, base),
            # A trial's driver process, reused by the next trial, keeps torch, Ray Train and raylane
            # imported. Not under PBT: its exploit must restart a trial from the donor's checkpoint.
            reuse_actors=sweep.scheduler != "pbt",
        ),
    )


# Tune's TensorBoard logger (see _fit), and Tune's own Ctrl-C: it would end its loop and return the
# trials as if the sweep had ended; Ctrl-C raises here as SIGTERM does (raylane.session), and
# the sweep stops its trials itself (TrialRuns.interrupted).
TUNE_ENVIRONMENT = {"TUNE_DISABLE_AUTO_CALLBACK_LOGGERS": "1", "TUNE_DISABLE_SIGINT_HANDLER": "1"}


@contextlib.contextmanager
def _tune_environment():
    """For this fit only: `raylane.tune()` may run in a user's process with Tune runs of its own."""
    previous = {key: os.environ.get(key) for key in TUNE_ENVIRONMENT}
    os.environ.update(TUNE_ENVIRONMENT)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
