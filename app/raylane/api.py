"""The Python API: every `raylane` command as a call, each in two halves. First its preparation
(`prepare_train`, `prepare_tune`, ...: one path for every door, since the CLI, raylane.cli, calls
these same functions): its input checked the same way and in the same order before Ray, torch's
workers, a job or MLflow start, each mistake one ConfigError naming the field and the value (exit
2 from the CLI, the exception itself from the API). Then the run, by its driver. A run started from
a shell and one started from a notebook behave alike; the doors differ only in how they report.

A call prints what the command prints, and nothing else: what Ray's workers, MLflow, Tune,
torch and transformers say goes to the library log the call names (raylane.logs.scope), and
`verbose=True` prints it too, as `--verbose` does. Whatever logging the caller set up is as it was
once the call returns.

Importing this module imports neither torch nor Ray: each call imports what it needs."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raylane import layout_checks, logs, pipelines_ref, prechecks, runrecord
from raylane.autotuning.record import RECORD_FILE
from raylane.config import BaseConfig, ConfigError, load_config
from raylane.config import autotune as autotune_config
from raylane.config.batching import HeldBatch, skipped_sizes, world_sizes
from raylane.config.sweep import SweepSection, check_sweep_layout, is_sweep_file, load_sweep
from raylane.lease import LEASE_FILES
from raylane.onray import output
from raylane.results import AutotuneSummary, ExportSummary, Status, SweepSummary, TrainSummary

if TYPE_CHECKING:
    from raylane.onray.sweep_plan import SweepPlan


def check(config: Any, overrides: Iterable[str] = ()) -> BaseConfig | SweepPlan:
    """`raylane check`: the validated, resolved config (ConfigError on bad input). Of a sweep file
    (`raylane tune`'s), its plan: `sweep`, `base` (the base config every trial starts from) and
    `trials` (each trial's changes to it, as Tune will draw them), without starting Ray."""
    if is_sweep_file(config):
        with output.scope(None, "check"):  # Ray Tune's import, for the draw
            return prepare_check_sweep(config, overrides)
    run = prepare_train(config, overrides)
    for note in run.notes:
        print(note, flush=True)
    return run.cfg


def train(
    config: Any,
    overrides: Iterable[str] = (),
    *,
    address: str | None = None,
    local: bool = False,
    register: str | None = None,
    summary_json: str | None = None,
    verbose: bool | None = None,
) -> TrainSummary:
    """`raylane train`: check the config (ConfigError before anything starts, or once the ranks
    have, when the pipeline's build(cfg) raises one: its MLflow run closed FAILED), train on Ray (or
    in this process with `local`, or as this torchrun rank) and return the run's summary
    (`status`, `metrics`, `run_id`, `checkpoint`, ...: raylane.results.TrainSummary). A run that
    already FINISHED as far as the config asks is not trained again: its summary comes back with
    `already_finished`. `verbose`: also print what the libraries say (`--verbose`; None: the
    RAYLANE_VERBOSE environment variable decides)."""
    with output.scope(verbose, "train"):
        run = prepare_train(config, overrides, summary_json=summary_json, local=local, address=address, joins=True)
        _stop_leftovers()
        if run.finished:  # nothing is trained or logged again
            return _already_finished(run, summary_json)
        for note in run.notes:
            print(note, flush=True)
        from raylane import driver

        return driver.train(
            run.cfg,
            use_ray=run.use_ray,
            folder=run.folder,
            pipeline=run.pipeline,
            address=run.address,
            summary_path=summary_json,
            register=register,
            held=run.held,
        )


def _already_finished(run: PreparedRun, summary_json: str | None) -> TrainSummary:
    """The summary of a run that FINISHED as far as its config asks, which says so."""
    assert run.finished is not None
    summary = TrainSummary.model_validate(
        {
            # A record an older raylane wrote carries its own schema_version: this summary is today's.
            **{
                k: v
                for k, v in run.finished.summary.items()
                if k in TrainSummary.model_fields and k != "schema_version"
            },
            "already_finished": True,
        }
    )
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone says so
        print(run.finished.line, flush=True)
        from raylane.tracking.runs import settle

        if closed := settle(run.cfg, run.folder):  # an MLflow run its server did not let close at the end
            print(closed, flush=True)
        summary.write(summary_json)
    return summary


def _stop_leftovers() -> None:
    """What an embedded Ray cluster of a driver killed earlier on this machine left running
    (raylane.onray.leftovers), stopped as a launch starts; under torchrun, by rank 0."""
    if os.environ.get("RANK", "0") == "0":
        from raylane.onray.leftovers import stop_leftovers

        stop_leftovers()


def tune(
    sweep: Any,
    overrides: Iterable[str] = (),
    *,
    address: str | None = None,
    register: str | None = None,
    summary_json: str | None = None,
    verbose: bool | None = None,
) -> SweepSummary:
    """`raylane tune`: run (or continue) a sweep; returns its summary (its trials and the best
    one). ConfigError on bad input, before Ray starts. `verbose`: as for `train`."""
    with output.scope(verbose, "tune"):
        prepared = prepare_tune(sweep, overrides, summary_json=summary_json, address=address)
        if prepared.finished:  # its records stay as they are
            print(prepared.finished, flush=True)
            summary = SweepSummary(status=Status.FINISHED, sweep=prepared.sweep.name, already_finished=True)
            summary.write(summary_json)
            return summary
        _stop_leftovers()
        from raylane.onray.tune import run_sweep

        summary = run_sweep(
            prepared.sweep, prepared.base, address=prepared.address, summary_path=summary_json, register=register
        )
        if logs.log_file():
            print(f"[raylane] library log: {logs.log_file()} (Ray, MLflow, Tune, torch; --verbose prints them)")
        return summary


def autotune(
    config: Any,
    overrides: Iterable[str] = (),
    *,
    address: str | None = None,
    local: bool = False,
    budget_s: float | None = None,
    out: str = "autotuned.yaml",
    summary_json: str | None = None,
    verbose: bool | None = None,
) -> AutotuneSummary:
    """`raylane autotune`: the fastest configuration that fits, written to `out` as a YAML ready
    to train; returns the search's summary. `verbose`: as for `train`."""
    with output.scope(verbose, "autotune"):
        search = prepare_autotune(
            config, overrides, out=out, summary_json=summary_json, budget_s=budget_s, local=local, address=address
        )
        _stop_leftovers()
        from raylane.autotuning import driver as search_module

        return search_module.execute(
            search.section,
            search.cfg,
            use_ray=search.use_ray,
            address=search.address,
            out=out,
            summary_path=summary_json,
        )


def submit(
    config: Any,
    overrides: Iterable[str] = (),
    *,
    address: str | None = None,
    working_dir: str = ".",
    env_vars: dict[str, str] | None = None,
    verbose: bool | None = None,
):
    """`raylane submit`: run `raylane train CONFIG` as a Ray job that records where this machine
    looks (raylane.onray.jobs); returns a handle with status(), logs(), follow(), wait(), stop()
    and mlflow_run_id(), and where the job records (`tracking_uri`, `experiment`,
    `storage_path`). ConfigError on bad input, an address that does not answer or a refused
    token; SubmitError when the cluster does not take the job. `verbose`: as for `train`, and
    the job's log then has what the libraries say too."""
    if verbose is not None:
        env_vars = {logs.VERBOSE_ENV: "1" if verbose else "0", **(env_vars or {})}
    with output.scope(verbose, "submit"):
        from raylane.onray import jobs

        overrides = list(overrides)
        target = jobs.job_target(address)  # on this machine or not decides how the config is checked
        # The one load and check of the config: ConfigError before anything leaves this machine.
        cfg = prepare_submit(config, overrides, here=target.here)
        return jobs.submit(config, cfg, target, overrides, working_dir=working_dir, env_vars=env_vars)


def export(
    checkpoint: str,
    out: str,
    *,
    format: str = "safetensors",
    adapter_only: bool = False,
    summary_json: str | None = None,
    verbose: bool | None = None,
) -> ExportSummary:
    """`raylane export`: a checkpoint's whole model as one safetensors file at `out`, with its
    config JSON beside it. `format="hf"`: a Hugging Face model's `save_pretrained` folder at `out`
    (a LoRA run merged, or its adapter alone with `adapter_only`). Returns what was written.
    `verbose`: as for `train`."""
    with output.scope(verbose, "export"):
        summary = _export(checkpoint, out, format, adapter_only, summary_json)
    if format == "hf":
        what = "a peft adapter" if adapter_only else "a save_pretrained model"
        print(f"wrote {what} to {out}: {', '.join(Path(f).name for f in summary.files)}", flush=True)
    else:
        print(f"wrote {out} and {Path(out).with_suffix('.config.json')}", flush=True)
    return summary


def _export(checkpoint: str, out: str, format: str, adapter_only: bool, summary_json: str | None) -> ExportSummary:
    checkpoint = prepare_export(checkpoint, out, format, adapter_only, summary_json)
    try:
        if format == "hf":
            from raylane.hf.export import export_checkpoint as write_hf

            folder = write_hf(checkpoint, out, adapter_only=adapter_only)
            files = sorted(str(p.resolve()) for p in Path(folder).iterdir())
        else:
            from raylane.export import export as write

            files = [str(Path(out).resolve()), str(Path(write(checkpoint, out)).resolve())]
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"export: {exc}") from None
    summary = ExportSummary(
        status=Status.FINISHED,
        checkpoint=str(checkpoint),
        format=format,
        adapter_only=adapter_only,
        out=str(Path(out).resolve()),
        files=files,
    )
    summary.write(summary_json)
    return summary


def up(num_cpus: int | None = None, port: int | None = None, dashboard_port: int | None = None, warm: int | None = 0):
    """`raylane up`: a persistent local Ray head (returns it, and whether this call started it).
    `warm`: the idle warm workers it keeps for runs' actors (0, the default: none; None: sized
    from its CPUs)."""
    num_cpus = max(4, os.cpu_count() or 1) if num_cpus is None else num_cpus
    prepare_up(num_cpus, warm)
    from raylane.clusters import local as localcluster

    cluster, started = localcluster.up(num_cpus, port, dashboard_port, warm)
    if started and cluster.warm:
        from raylane.onray import warmpool

        warmpool.fill(cluster)  # the head's warm workers start in the background
    return cluster, started


def down():
    """`raylane down`: stop the local Ray head `up` started; returns it, or None."""
    from raylane.clusters import local as localcluster

    return localcluster.down()


# -- each call's preparation: its checks, before anything starts ---------------------------------


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


@dataclass
class PreparedRun:
    """A training run that passed every check, with what the checks found once for the whole
    launch: its config, whether it runs on Ray, its folder and pipeline, the cluster it joins,
    and, for a run that already FINISHED as far as this config asks, what to say instead."""

    cfg: BaseConfig
    use_ray: bool
    # raylane.runrecord.run_folder of the name the config gives (None: none given, or object
    # storage); a generated name's is found with the name (raylane.driver.finalize_run).
    folder: Path | None
    pipeline: pipelines_ref.Resolved
    address: str | None = None  # the cluster a Ray run joins (None: a fresh embedded one)
    finished: runrecord.Finished | None = None
    notes: list[str] = field(default_factory=list)  # lines to show before it starts
    held: HeldBatch | None = None  # the global batch held on the world the run is planned for


def prepare_train(
    config: Any,
    overrides: Iterable[str] = (),
    *,
    summary_json: str | None = None,
    local: bool = False,
    address: str | None = None,
    joins: bool = False,
) -> PreparedRun:
    """`raylane check` and `raylane train` (on Ray, in one process with `local`, or as a torchrun
    rank): the config, what the run writes, the global batch on its world sizes, and what an
    earlier launch of the same run left; with `joins`, the cluster a Ray run joins (`address`, or
    RAY_ADDRESS, or `raylane up`'s head), which must answer."""
    cfg = load_config(config, list(overrides))
    folder, pipeline = runrecord.run_folder(cfg), pipelines_ref.resolve(cfg.pipeline)
    prechecks.check_run(cfg, folder=folder, summary_json=summary_json)
    in_process = local or under_torchrun()
    notes = []
    if in_process:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        where = f"torchrun's WORLD_SIZE = {world}" if under_torchrun() else "the one process of --local"
        layout_checks.check_replica_groups(cfg, where)
        layout_checks.check_layout(cfg, world, where, pipeline)
    else:
        world = cfg.scaling.num_workers
        layout_checks.check_replica_groups(cfg, None)
        layout_checks.check_layout(cfg, *layout_checks.layout_world(cfg), pipeline)  # a replica group's, if any
    # Held once, here: the ranks train with it on this world (raylane.loop.run holds it again only
    # on another: an elastic run's); this config, as given, is what MLflow records.
    held = HeldBatch.of(cfg, world)
    if not in_process and cfg.scaling.elastic:
        notes.extend(skipped_sizes(cfg, world_sizes(cfg)))  # the global batch splits at min and max
    prechecks.check_global_order(cfg, pipeline)
    finished = prechecks.check_resume(cfg, folder)
    run = PreparedRun(cfg, not in_process, folder, pipeline, finished=finished, notes=notes, held=held)
    if not run.finished:  # the plan and stages on the model (tp, pp): one build of it, here
        unchecked = layout_checks.check_plan(cfg, world if in_process else layout_checks.layout_world(cfg)[0])
        notes.extend(unchecked if os.environ.get("RANK", "0") == "0" else [])  # under torchrun, rank 0 says it
    if joins and run.use_ray and not run.finished:
        run.address = joined_address(address, cfg)
    return run


def joined_address(address: str | None, cfg: BaseConfig) -> str | None:
    """The cluster a Ray run joins (None: a fresh embedded one), resolved before Ray's import (see
    raylane.clusters.local.resolve_address): one named must answer as one
    (raylane.clusters.addresses: sockets only, milliseconds; Ray itself would wait for minutes).
    A fresh embedded one that would give the workers more CPUs than this machine has is warned of."""
    from raylane.clusters.addresses import check_gcs_address
    from raylane.clusters.local import resolve_address

    check_gcs_address(address or os.environ.get("RAY_ADDRESS"))
    address = resolve_address(address)
    if warning := prechecks.oversubscription(cfg, address):
        print(f"raylane: {warning}", file=sys.stderr, flush=True)
    return address


@dataclass
class PreparedSweep:
    """A sweep that passed every check: its section, its base config, the cluster it joins, and
    for a sweep that already FINISHED with these settings, what to say instead of sweeping again."""

    sweep: SweepSection
    base: BaseConfig
    finished: str | None  # the line to show instead of sweeping again
    address: str | None = None


def prepare_tune(
    sweep_file: Any, overrides: Iterable[str] = (), *, summary_json: str | None = None, address: str | None = None
) -> PreparedSweep:
    from raylane.sweeps.record import check_rerun

    sweep, base = load_sweep(sweep_file, list(overrides))
    check_sweep_layout(sweep, base)
    prechecks.check_run(base, folder=runrecord.run_folder(base), summary_json=summary_json)
    prepared = PreparedSweep(sweep, base, check_rerun(sweep, base))
    if not prepared.finished:
        prepared.address = joined_address(address, base)
    return prepared


def prepare_check_sweep(sweep_file: Any, overrides: Iterable[str] = ()) -> Any:
    """`raylane check SWEEP.yaml`: what `raylane tune` checks before Ray starts (the sweep, its
    base config, a rerun's settings), and the trials it would run (raylane.onray.sweep_plan)."""
    from raylane.onray.sweep_plan import SweepPlan, planned_trials
    from raylane.sweeps.record import check_rerun

    sweep, base = load_sweep(sweep_file, list(overrides))
    check_sweep_layout(sweep, base)
    prechecks.check_run(base, folder=runrecord.run_folder(base))
    finished = check_rerun(sweep, base)
    return SweepPlan(sweep, base, planned_trials(sweep, base), finished)


@dataclass
class PreparedSearch:
    """An autotune search that passed every check: its section, its config, whether it runs on
    Ray, and the cluster it joins there."""

    section: autotune_config.AutotuneSection
    cfg: BaseConfig
    use_ray: bool
    address: str | None = None


def prepare_autotune(
    config: Any,
    overrides: Iterable[str] = (),
    *,
    out: str = "autotuned.yaml",
    summary_json: str | None = None,
    budget_s: float | None = None,
    local: bool = False,
    address: str | None = None,
) -> PreparedSearch:
    overrides = [*overrides, *([f"autotune.budget_s={budget_s}"] if budget_s is not None else [])]
    section, cfg = autotune_config.load(config, overrides)
    if under_torchrun():  # the ranks torchrun started, whatever scaling.num_workers says
        workers = int(os.environ.get("WORLD_SIZE", "1"))
        cfg = cfg.model_copy(update={"scaling": cfg.scaling.model_copy(update={"num_workers": workers})})
    autotune_config.space(section, cfg)
    _check_autotune(cfg, out, summary_json)
    search = PreparedSearch(section, cfg, use_ray=not (local or under_torchrun()))
    if search.use_ray:
        search.address = joined_address(address, cfg)
    return search


def _check_autotune(cfg: BaseConfig, out: str, summary_json: str | None) -> None:
    """What can fail before a search starts: the outputs (never overwritten) and the config."""
    folder = runrecord.run_folder(cfg)
    prechecks.check_run(cfg, folder=folder, summary_json=summary_json)
    if (
        folder is not None
        and folder.is_dir()
        and not (folder / RECORD_FILE).exists()
        and any(p.name not in LEASE_FILES for p in folder.iterdir())
    ):
        raise ConfigError(
            f"run.name = {cfg.run.name!r}: a training run of that name exists in {str(folder)!r}; "
            "give the search a name of its own"
        )
    if Path(out).exists():
        raise ConfigError(
            f"--out = {out!r}: already exists (an earlier autotune's result is never overwritten); name another file"
        )
    prechecks.writable_file("--out", out)


def prepare_submit(config: Any, overrides: Iterable[str] = (), *, here: bool = False) -> BaseConfig:
    """A job's config, loaded and checked once, on this machine, before anything is uploaded. On
    a cluster elsewhere, `run.storage_path` and the inputs are the cluster's to check and left as
    written (raylane.onray.jobs decides what the job gets); on one `here`, on this machine, the
    job uses this machine's paths: resolved and checked as `raylane train` here would (its storage
    probed, its inputs found). The job's driver reads `env:`'s `${NAME}` values where it runs."""
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            f"config = {type(config).__name__}: a job reads its config on the cluster; give the path "
            "of a config file (or a shipped config's name), not a mapping"
        )
    cfg = load_config(config, list(overrides), outputs=here)
    folder = runrecord.run_folder(cfg) if here else None
    prechecks.check_run(cfg, folder=folder, local_storage=here, driver_env=False)
    world = cfg.scaling.num_workers
    layout_checks.check_layout(cfg, world, f"scaling.num_workers = {world}", pipelines_ref.resolve(cfg.pipeline))
    return cfg


def prepare_export(
    checkpoint: str, out: str, fmt: str = "safetensors", adapter_only: bool = False, summary_json: str | None = None
) -> str:
    """The checkpoint to export (a run's folder: its newest valid checkpoint, said in one line),
    after checking the arguments."""
    if summary_json:
        prechecks.writable_file("--summary-json", summary_json)
    checkpoint = prechecks.newest_in_run(checkpoint)
    if fmt == "hf":
        prechecks.check_export_hf(checkpoint, out, adapter_only)
        return checkpoint
    if adapter_only:
        raise ConfigError("--adapter-only: only with --format hf (a peft adapter folder)")
    prechecks.check_export(checkpoint, out)
    return checkpoint


def prepare_up(num_cpus: int, warm: int | None = None) -> None:
    if num_cpus < 1:
        raise ConfigError(f"up: --num-cpus must be at least 1, got {num_cpus}")
    if warm is not None and warm < 0:
        raise ConfigError(f"up: --warm must be 0 or more, got {warm}")
    prechecks.check_token_path()
