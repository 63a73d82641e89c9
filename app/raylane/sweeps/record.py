"""A sweep's record, beside its schema (raylane.config.sweep).

A sweep's folder (`<run.storage_path>/<sweep.name>`, Tune's experiment) holds `SWEEP_RECORD`:
the settings it ran with and how it ended. Rerunning the name with other settings is refused
before Ray starts (Tune would restore the old search and silently ignore them, then the end of
the sweep would rewrite the earlier results); rerunning it unchanged continues it, or, once it
finished, says so and leaves everything as it is. Nothing here imports torch or Ray."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from raylane import paths
from raylane.config import BaseConfig, ConfigError, flatten
from raylane.config.sweep import SweepSection
from raylane.results import Status

SWEEP_RECORD = "raylane_sweep.json"


def resolved(base: BaseConfig) -> BaseConfig:
    """`base` with a local storage path made absolute: where the sweep's folder is, from any
    working directory, and how its settings are recorded."""
    storage = base.run.storage_path
    if "://" in storage:
        return base
    return base.model_copy(
        update={"run": base.run.model_copy(update={"storage_path": str(Path(storage).expanduser().resolve())})}
    )


def sweep_folder(sweep: SweepSection, base: BaseConfig) -> Path | None:
    """The sweep's folder, when it is on this machine (object storage is not checked)."""
    base = resolved(base)
    return None if "://" in base.run.storage_path else Path(base.run.storage_path) / sweep.name


def settings(sweep: SweepSection, base: BaseConfig) -> dict[str, Any]:
    """Dotted key -> value of everything that decides what the sweep runs: its own section, then
    the base config every trial starts from. Not the storage path: the record is found under it,
    so it matches whenever there is a record to compare with, however the path was written."""
    own = sweep.model_dump(mode="json")
    for key, unset in (("objective", None), ("global_batch", None), ("pbt_synchronous", False)):
        if own.get(key) == unset:  # as a sweep recorded before these existed
            own.pop(key, None)
    space = own.pop("space")  # one entry per searched key: its whole domain is its value
    flat = {**flatten({"sweep": own}), **{f"sweep.space.{k}": v for k, v in space.items()}, **base.flat()}
    flat.pop("run.storage_path", None)
    # A sweep never has replica groups (config.sweep refuses them): their keys, added after sweeps
    # were recorded, decide nothing it runs, and would stop every earlier sweep from continuing.
    return {k: v for k, v in flat.items() if not k.startswith("fault_tolerance.")}


def _shown(settings_: dict[str, Any], key: str) -> str:
    return repr(settings_[key]) if key in settings_ else "(not set)"


def read_record(sweep: SweepSection, base: BaseConfig) -> dict[str, Any] | None:
    folder = sweep_folder(sweep, base)
    try:
        record = json.loads((folder / SWEEP_RECORD).read_text()) if folder else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("settings"), dict) else None


def check_rerun(sweep: SweepSection, base: BaseConfig) -> str | None:
    """Before Ray: ConfigError when this sweep name already ran with other settings (naming the
    first that differs); the line to print when it already finished with these; else None (a
    new sweep, or one to continue)."""
    folder, record = sweep_folder(sweep, base), read_record(sweep, base)
    if folder is None or record is None:
        return None
    old, new = _absolute_paths(record["settings"], base), settings(sweep, base)
    for key in dict.fromkeys([*new, *old]):  # the sweep's own keys first, then the base config's
        if (key in old, old.get(key)) != (key in new, new.get(key)):
            raise ConfigError(
                f"{key} = {_shown(new, key)}: sweep {sweep.name!r} already ran with {key} = {_shown(old, key)} "
                f"({str(folder)!r}), and a sweep's settings cannot change: start a new sweep with "
                f"--set sweep.name={fresh_sweep_name(folder)}, or rerun it unchanged to continue it"
            )
    if record.get("status") != Status.FINISHED:
        return None
    best = record.get("best") or {}
    outcome = (
        f"best trial {best['trial_id']}: {sweep.metric} {best['metric']:.4f}"
        if best.get("trial_id")
        else "no best trial"
    )
    trials = record.get("trials")
    return (
        f"sweep {sweep.name}: already FINISHED ({trials} trial{'' if trials == 1 else 's'}, {outcome}); results in "
        f"{folder} and MLflow parent run {record.get('parent_run_id')}. Nothing to run: to sweep again, "
        f"start a new sweep with --set sweep.name={fresh_sweep_name(folder)}"
    )


def _absolute_paths(recorded: dict[str, Any], base: BaseConfig) -> dict[str, Any]:
    """A record's settings with the relative paths of a sweep recorded before raylane resolved
    them (raylane.paths) made absolute as they were then, from the working directory."""
    out = dict(recorded)
    for key in paths.path_keys(type(base)):
        value = out.get(key)
        if isinstance(value, str):
            out[key] = paths.absolute(value, Path.cwd())
        elif isinstance(value, list):
            out[key] = [paths.absolute(v, Path.cwd()) if isinstance(v, str) else v for v in value]
    return out


def fresh_sweep_name(folder: Path) -> str:
    n = 2
    while folder.with_name(f"{folder.name}-{n}").exists():
        n += 1
    return f"{folder.name}-{n}"


def write_record(sweep: SweepSection, base: BaseConfig, status: str, **outcome: Any) -> None:
    """The sweep's settings and state, into its folder (made here when new): RUNNING when it
    starts or continues, then how it ended (its status, parent run, best trial, trial count)."""
    folder = sweep_folder(sweep, base)
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (SWEEP_RECORD + ".tmp")
    record = {"status": status, "settings": settings(sweep, base), **outcome}
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, folder / SWEEP_RECORD)  # whole or not at all: a torn record would let any rerun through
