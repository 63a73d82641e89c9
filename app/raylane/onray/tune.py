"""`raylane tune SWEEP.yaml`: Ray Tune sweeps whose trials are multi-worker Ray Train runs, each
recorded as a nested MLflow run under one parent run per sweep.

Ray 2.60's Train V2 no longer runs `Tuner(trainer)`: every trial is a small driver function
(`_trial`) that builds its own `TorchTrainer` (through `raylane.onray.launch.launch_on_ray`, as `raylane
train` does) and forwards rank 0's epoch-end results to Tune with a checkpoint that points at
raylane's own checkpoint, which is what ASHA stops on and what PBT copies between trials. The
MLflow child runs are opened by the trials; each is closed by one writer: the trial, after its
records, when its run returns or fails; this driver (`TrialRuns`, in `raylane.onray.trials`) when
Tune stops the trial while it runs, once its ranks have stopped at their next step boundary, so a
trial stopped early is never left RUNNING, nor trains on."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
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
from raylane.loop.events import Checkpoint, Event
from raylane.loop.result import RunResult
from raylane.onray.cluster import data_cpus
from raylane.onray.placement import check_placeable, put_env
from raylane.onray.sweep_plan import param_space, search_alg, trials_text
from raylane.onray.trials import MetricReported, TrialRuns, sink_name
from raylane.results import Status, SweepSummary
from raylane.session import RunSession, interrupts, ran, status_of
from raylane.sweeps import results as sweep_results
from raylane.sweeps.objective import Objective
from raylane.sweeps.record import fresh_sweep_name, resolved, sweep_folder, write_record
from raylane.sweeps.results import SWEEP_TAG, TRIAL_TAG
from raylane.tracking.progress import plural
from raylane.tracking.runs import (
    RUN_NAME_TAG,
    RunHandle,
    close_run,
    mlflow_client,
    resolve_tracking_uri,
    run_tags,
    table_metrics,
    ui_command,
    use_experiment,
)

log = logging.getLogger("raylane")

PARENT_TAG = "mlflow.parentRunId"
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


# -- MLflow ------------------------------------------------------------------------------------


def open_parent(sweep: SweepSection, base: BaseConfig, tracking_uri: str) -> RunHandle:
    """The sweep's parent run: created, or continued when the same sweep name runs again."""
    client = mlflow_client(tracking_uri)
    exp_id = use_experiment(client, base.mlflow.experiment, table_metrics(base, sweep.metric))
    found = [
        r
        for r in client.search_runs([exp_id], filter_string=f"tags.`{SWEEP_TAG}` = '{sweep.name}'")
        if TRIAL_TAG not in r.data.tags
    ]  # the parent: the one run of the sweep that is no trial
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
    else:
        tags = {
            **run_tags(base, base.scaling.num_workers),
            SWEEP_TAG: sweep.name,
            RUN_NAME_TAG: sweep.name,
            "raylane.sweep.algorithm": sweep.algorithm,
            "raylane.sweep.scheduler": sweep.scheduler,
        }
        run_id = client.create_run(exp_id, run_name=sweep.name, tags=tags).info.run_id
        from mlflow.entities import Param

        params = [
            Param(f"sweep.{k}", json.dumps(v) if isinstance(v, (dict, list)) else str(v))
            for k, v in sweep.model_dump(mode="json").items()
        ]
        client.log_batch(run_id, params=params)
    return RunHandle(run_id, exp_id, tracking_uri, resumed=bool(found))


def _child(
    client, parent: RunHandle, trial_id: str, sweep: SweepSection, cfg: BaseConfig, params: dict[str, Any]
) -> str:
    found = client.search_runs(
        [parent.experiment_id],
        max_results=1,
        filter_string=f"tags.`{TRIAL_TAG}` = '{trial_id}' and tags.`{SWEEP_TAG}` = '{sweep.name}'",
    )
    if found:  # the trial restarted: after a failure, a driver's death or a PBT pause
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        for tag in ("raylane.early_stopped", "raylane.stopped_at_epoch"):  # paused, not stopped
            if tag in found[0].data.tags:
                client.delete_tag(run_id, tag)
        return run_id
    tags = {
        **run_tags(cfg, cfg.scaling.num_workers),
        PARENT_TAG: parent.run_id,
        SWEEP_TAG: sweep.name,
        TRIAL_TAG: trial_id,
    }
    run_id = client.create_run(parent.experiment_id, run_name=trial_id, tags=tags).info.run_id
    from mlflow.entities import Param

    flat = cfg.flat()
    batch = [Param(k, str(v)[:6000]) for k, v in flat.items()]
    for i in range(0, len(batch), 100):
        client.log_batch(run_id, params=batch[i : i + 100])
    return run_id


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


def _record_values(client: Any, run_id: str, params: dict[str, Any], donor: dict[str, Any] | None) -> None:
    """The trial's values as `hparam/*` metrics (PBT may change them: a metric, not a param), and
    under a PBT exploit, which trial it continues and how many times it has."""
    if donor:
        exploits = int(client.get_run(run_id).data.tags.get("raylane.pbt.exploits", "0")) + 1
        client.set_tag(run_id, "raylane.pbt.exploits", str(exploits))
        client.set_tag(run_id, "raylane.pbt.last_donor", f"{donor['trial_id']} at step {donor['step']}")
    for key, value in params.items():
        if isinstance(value, (int, float)):
            client.log_metric(run_id, f"hparam/{key}", float(value), step=donor["step"] if donor else 0)


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
    run_id = _child(client, parent, trial_id, sweep, cfg, params)
    _record_values(client, run_id, params, donor)
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
    `status` is FINISHED when every trial ended cleanly and FAILED otherwise. Every way out closes
    the sweep's MLflow parent run (KILLED on SIGTERM or Ctrl-C) and gives its lease back (its
    session: raylane.session)."""
    from raylane.onray.cluster import init_ray, shutdown_ray

    tracking_uri = resolve_tracking_uri()
    base = resolved(base)
    with RunSession() as session:
        _lease(sweep, base, session)  # one writer per sweep: before its records or its MLflow run
        with interrupts():  # a joined cluster installs no handler of Ray's: ours, throughout
            parent = session.open(open_parent, sweep, base, tracking_uri)
            write_record(sweep, base, "RUNNING", parent_run_id=parent.run_id)
            per_trial = trial_resources(base)["CPU"]
            embedded = init_ray(
                address, base, num_cpus=math.ceil(per_trial * (sweep.max_concurrent_trials or 2)), dashboard=True
            )
            if embedded:
                session.defer(shutdown_ray, embedded)
            summary, rows, best = _sweep(sweep, base, session, parent, embedded, register)
    summary.write(summary_path)
    print(sweep_results.table(rows, sweep), flush=True)
    if best:
        print(
            f"best trial {best['trial_id']}: {sweep.metric} {best['metric']:.4f} (MLflow run {best['run_id']})",
            flush=True,
        )
    print(f"[raylane] MLflow UI: {ui_command(tracking_uri, parent)}", flush=True)
    return summary


def _sweep(
    sweep: SweepSection, base: BaseConfig, session: RunSession, parent: RunHandle, embedded: bool, register: str | None
) -> tuple[SweepSummary, list[dict[str, Any]], dict[str, Any] | None]:
    """The trials on the cluster Ray joined, and their results on the parent run: (summary,
    rows, best trial)."""
    check_placeable(base, embedded)  # a trial's workers fit some node (accelerator, resources, labels)
    concurrency = check_resources(base, sweep, ray.cluster_resources(), embedded)
    print(
        f"[raylane] sweep {sweep.name}: {trials_text(sweep)}, {concurrency} at a time, "
        f"{plural(base.scaling.num_workers, 'worker')} per trial; MLflow parent run {parent.run_id}",
        flush=True,
    )
    random.seed(sweep.seed)  # PBT's explore draws from Python's generator
    started = time.monotonic()
    stopper = MetricReported(sweep.metric)
    grid = _fit(sweep, base, parent, concurrency, stopper)
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


def _fit(sweep: SweepSection, base: BaseConfig, parent: RunHandle, concurrency: int, stopper: tune.Stopper):
    context = {
        "sweep": sweep.model_dump(mode="json"),
        "base": base.model_dump(mode="json"),
        "parent": {
            "run_id": parent.run_id,
            "experiment_id": parent.experiment_id,
            "tracking_uri": parent.tracking_uri,
            "resumed": False,
        },
        "env": put_env(base),  # a reference: the trial's `params.json` and Tune's records never hold the values
    }
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    trainable = tune.with_resources(tune.with_parameters(_trial, context=context), {"CPU": TRIAL_DRIVER_CPU})
    path = f"{base.run.storage_path.rstrip('/')}/{sweep.name}"
    # Tune's default loggers, less its TensorBoard one: tensorboardX imports torch into this
    # driver, ~2 s of CPU before the first trial starts (the sweep's metrics are in MLflow). Tune
    # adds all three unless told not to (_without_tune_auto_loggers), so the other two are named.
    trial_runs = TrialRuns(parent, sweep, base.train.epoch_limit)
    run_config = tune.RunConfig(
        name=sweep.name,
        storage_path=base.run.storage_path,
        verbose=1 if logs.verbose() else 0,  # --verbose: Tune's status tables too
        callbacks=[trial_runs, CSVLoggerCallback(), JsonLoggerCallback()],
        stop=stopper,
        failure_config=tune.FailureConfig(max_failures=base.failure.max_failures),
    )
    # A trial's driver process, reused by the next trial, keeps torch, Ray Train and raylane
    # imported. Not under PBT: its exploit must restart a trial from the donor's checkpoint.
    if tune.Tuner.can_restore(path):
        print(f"[raylane] continuing sweep {sweep.name} from {path}", flush=True)
        tuner = tune.Tuner.restore(
            path, trainable, resume_unfinished=True, resume_errored=True, param_space=param_space(sweep)
        )
    else:
        tuner = tune.Tuner(
            trainable,
            param_space=param_space(sweep),
            run_config=run_config,
            tune_config=tune.TuneConfig(
                num_samples=sweep.num_samples,
                search_alg=search_alg(sweep, concurrency),
                scheduler=_scheduler(sweep, base),
                reuse_actors=sweep.scheduler != "pbt",
            ),
        )
    try:
        with _without_tune_auto_loggers():
            return tuner.fit()
    finally:
        trial_runs.wait()  # the stopped trials' runs closed before the results are read


@contextlib.contextmanager
def _without_tune_auto_loggers():
    """For this fit only: `raylane.tune()` may run in a user's process with Tune runs of its own."""
    key, previous = "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", os.environ.get("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS")
    os.environ[key] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
