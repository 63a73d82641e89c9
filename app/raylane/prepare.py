"""One preparation path for every door: `raylane check`, `train`, `tune`, `autotune`, `submit`,
`export` and `up`, and the Python API's calls of the same names (`raylane.train()`, ...), check
their input here, the same way and in the same order, before Ray, torch's workers, a job or
MLflow start. Each mistake is one ConfigError naming the field and the value: exit 2 from the
CLI, the exception itself from the API. What the doors then do with a prepared run differs only
in how they report it.

Nothing here imports torch or Ray."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raylane import layout_checks, pipelines_ref, prechecks, runrecord
from raylane.autotuning.record import RECORD_FILE
from raylane.config import BaseConfig, ConfigError, autotune, load_config
from raylane.config.batching import HeldBatch, world_sizes
from raylane.config.sweep import SweepSection, load_sweep
from raylane.lease import LEASE_FILES


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
    # storage); a generated name's is found with the name (raylane.session.finalize_run).
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
        layout_checks.check_layout(cfg, world, where, pipeline)
    else:
        world = cfg.scaling.num_workers
        layout_checks.check_layout(cfg, world, f"scaling.num_workers = {world}", pipeline)
    # Held once, here: the ranks train with it on this world (raylane.loop.run holds it again only
    # on another: an elastic run's); this config, as given, is what MLflow records.
    held = HeldBatch.of(cfg, world)
    if not in_process and cfg.scaling.elastic:
        notes.extend(_skipped_sizes(cfg, world_sizes(cfg)))  # the global batch splits at min and max
    prechecks.check_global_order(cfg, pipeline)
    finished = prechecks.check_resume(cfg, folder)
    run = PreparedRun(cfg, not in_process, folder, pipeline, finished=finished, notes=notes, held=held)
    if not run.finished:  # the plan and stages on the model (tp, pp): one build of it, here
        unchecked = layout_checks.check_plan(cfg, world)
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


def _skipped_sizes(cfg: BaseConfig, sizes: list[int]) -> list[str]:
    """An elastic run skips the sizes between min and max that do not split its global batch."""
    skipped = sorted(set(range(sizes[0], sizes[-1] + 1)) - set(sizes))
    if not (skipped and cfg.scaling.elastic):
        return []
    shown = ", ".join(map(str, skipped[:8])) + (", ..." if len(skipped) > 8 else "")
    line = (
        f"raylane: elastic run on {', '.join(map(str, sizes[:8]))}{', ...' if len(sizes) > 8 else ''} "
        f"workers: {shown} would not split the global batch, so it runs on the next size down"
    )
    return [line]


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
    _check_sweep_layout(sweep, base)
    prechecks.check_run(base, folder=runrecord.run_folder(base), summary_json=summary_json)
    prepared = PreparedSweep(sweep, base, check_rerun(sweep, base))
    if not prepared.finished:
        prepared.address = joined_address(address, base)
    return prepared


def _check_sweep_layout(sweep: SweepSection, base: BaseConfig) -> None:
    """Sweeps train data-parallel trials only, for now: each trial's layout is not checked."""
    swept = [k for k in sweep.space if k in ("strategy.tp", "strategy.sequence_parallel", "strategy.pp")]
    if base.strategy.pp > 1:
        raise ConfigError(
            f"strategy.pp = {base.strategy.pp}: sweeps of pipeline-parallel runs are not built yet; sweep with "
            "strategy.pp: 1"
        )
    if swept or base.strategy.tensor_parallel:
        key = f"sweep.space.{swept[0]}" if swept else f"strategy.tp = {base.strategy.tp!r}"
        raise ConfigError(f"{key}: sweeps of tensor-parallel runs are not built yet; sweep with strategy.tp: 1")


def is_sweep_file(config: Any) -> bool:
    """A config file with a `sweep:` section (`raylane tune`'s), which `raylane check` also takes."""
    from raylane.config import read_yaml

    return isinstance(config, (str, Path)) and isinstance(read_yaml(config).get("sweep"), dict)


def prepare_check_sweep(sweep_file: Any, overrides: Iterable[str] = ()) -> Any:
    """`raylane check SWEEP.yaml`: what `raylane tune` checks before Ray starts (the sweep, its
    base config, a rerun's settings), and the trials it would run (raylane.onray.sweep_plan)."""
    from raylane.onray.sweep_plan import SweepPlan, planned_trials
    from raylane.sweeps.record import check_rerun

    sweep, base = load_sweep(sweep_file, list(overrides))
    _check_sweep_layout(sweep, base)
    prechecks.check_run(base, folder=runrecord.run_folder(base))
    finished = check_rerun(sweep, base)
    return SweepPlan(sweep, base, planned_trials(sweep, base), finished)


@dataclass
class PreparedSearch:
    """An autotune search that passed every check: its section, its config, whether it runs on
    Ray, and the cluster it joins there."""

    section: autotune.AutotuneSection
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
    section, cfg = autotune.load(config, overrides)
    if cfg.strategy.tensor_parallel:
        raise ConfigError(
            f"strategy.tp = {cfg.strategy.tp!r}: autotune does not search tensor-parallel layouts yet; "
            "autotune with strategy.tp: 1"
        )
    if cfg.strategy.pp > 1:
        raise ConfigError(
            f"strategy.pp = {cfg.strategy.pp}: autotune does not search pipeline-parallel layouts yet; "
            "autotune with strategy.pp: 1"
        )
    if under_torchrun():  # the ranks torchrun started, whatever scaling.num_workers says
        workers = int(os.environ.get("WORLD_SIZE", "1"))
        cfg = cfg.model_copy(update={"scaling": cfg.scaling.model_copy(update={"num_workers": workers})})
    autotune.space(section, cfg)
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
