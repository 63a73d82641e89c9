"""The Python API: every `raylane` command as a call. The CLI (raylane.cli) calls these same
functions, so a run started from a shell and one started from a notebook are checked by one
preparation path (raylane.prepare) and behave alike: bad input raises ConfigError, with the line
the CLI prints, before anything starts.

A call prints what the command prints, and nothing else: what Ray's workers, MLflow, Tune,
torch and transformers say goes to the library log the call names (raylane.logs.scope), and
`verbose=True` prints it too, as `--verbose` does. Whatever logging the caller set up is as it was
once the call returns.

Importing this module imports neither torch nor Ray: each call imports what it needs."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raylane import logs, prepare
from raylane.config import BaseConfig, ConfigError
from raylane.onray import output
from raylane.results import AutotuneSummary, ExportSummary, Status, SweepSummary, TrainSummary

if TYPE_CHECKING:
    from raylane.onray.sweep_plan import SweepPlan


def check(config: Any, overrides: Iterable[str] = ()) -> BaseConfig | SweepPlan:
    """`raylane check`: the validated, resolved config (ConfigError on bad input). Of a sweep file
    (`raylane tune`'s), its plan: `sweep`, `base` (the base config every trial starts from) and
    `trials` (each trial's changes to it, as Tune will draw them), without starting Ray."""
    if prepare.is_sweep_file(config):
        with output.scope(None, "check"):  # Ray Tune's import, for the draw
            return prepare.prepare_check_sweep(config, overrides)
    run = prepare.prepare_train(config, overrides)
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
    """`raylane train`: check the config (ConfigError before anything starts), train on Ray (or
    in this process with `local`, or as this torchrun rank) and return the run's summary
    (`status`, `metrics`, `run_id`, `checkpoint`, ...: raylane.results.TrainSummary). A run that
    already FINISHED as far as the config asks is not trained again: its summary comes back with
    `already_finished`. `verbose`: also print what the libraries say (`--verbose`; None: the
    RAYLANE_VERBOSE environment variable decides)."""
    with output.scope(verbose, "train"):
        run = prepare.prepare_train(
            config, overrides, summary_json=summary_json, local=local, address=address, joins=True
        )
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


def _already_finished(run: prepare.PreparedRun, summary_json: str | None) -> TrainSummary:
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
        prepared = prepare.prepare_tune(sweep, overrides, summary_json=summary_json, address=address)
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
        search = prepare.prepare_autotune(
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
        cfg = prepare.prepare_submit(config, overrides, here=target.here)
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
    checkpoint = prepare.prepare_export(checkpoint, out, format, adapter_only, summary_json)
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
    prepare.prepare_up(num_cpus, warm)
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
