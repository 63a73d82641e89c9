"""The record a run leaves in its folder (`runs/<name>`, under `run.storage_path`): after a run
FINISHED, the driver writes its summary there (`RUN_RECORD`), and the next launch of the same
`run.name` reads it without MLflow (which may be slow, far or off). A run already finished as far
as the config asks is not trained again (`Finished`); a later launch that fails leaves its MLflow
run FINISHED (`closing_status`). Nothing here imports torch or Ray."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raylane.config import BaseConfig
from raylane.loop.checkpoint.manifest import CHECKPOINT_PREFIX, read_manifest
from raylane.results import Status, TrainSummary

log = logging.getLogger("raylane")

RUN_RECORD = "raylane_run.json"


@dataclass
class Finished:
    """A run that already reached the end this config asks for: `line` says so, `summary` is the
    one it finished with."""

    line: str
    summary: dict[str, Any]


def run_folder(cfg: BaseConfig) -> Path | None:
    """Where the run's checkpoints and record live, when it has a name and local storage (the
    checks skip object storage: a round trip per launch, for a rare case). Found once per launch,
    as soon as the run's name is known (raylane.api.prepare_train for a name the config gives,
    raylane.driver.finalize_run for one it generates), and handed to everything after."""
    if not cfg.run.name or "://" in cfg.run.storage_path:
        return None
    return Path(cfg.run.storage_path).expanduser().resolve() / cfg.run.name


def fresh_start(cfg: BaseConfig, folder: Path | None) -> str | None:
    """The line a launch that names its run says when no run of that name is where it looks
    (`folder`): outputs are relative to the working directory, so the same config launched from
    another folder starts afresh there. None when the run is there, or its storage is object
    storage."""
    if folder is None or folder.exists():
        return None
    where, here = folder.parent, Path.cwd()
    shown = f"./{where.relative_to(here)}" if where.is_relative_to(here) and where != here else str(where)
    return f"no run {cfg.run.name!r} under {shown}: starting a fresh one"


def fresh_name(cfg: BaseConfig) -> str:
    """A run name next to this one with no folder yet."""
    parent, n = Path(cfg.run.storage_path).expanduser(), 2
    while (parent / f"{cfg.run.name}-{n}").exists():
        n += 1
    return f"{cfg.run.name}-{n}"


def newest_manifest(folder: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in a run's `folder` with a readable manifest: (its path, the manifest)."""
    # Names are zero-padded steps: the newest sorts last. An unreadable manifest is skipped, as
    # the trainer skips that checkpoint too.
    for path in sorted(folder.glob(CHECKPOINT_PREFIX + "*"), reverse=True):
        try:
            return path, read_manifest(path)
        except (OSError, ValueError):
            continue
    return None


def read_record(folder: Path) -> dict[str, Any] | None:
    """The record in a run's `folder` (None when there is none, or it cannot be read)."""
    try:
        record = json.loads((folder / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def already_finished(cfg: BaseConfig, folder: Path) -> Finished | None:
    """Finished, when the record in the run's `folder` says the run FINISHED as far as this
    config's limits ask (or stopped early); None when it may train further."""
    record = read_record(folder)
    if not record or record.get("status") != Status.FINISHED or not isinstance(record.get("summary"), dict):
        return None
    summary = record["summary"]
    steps, epochs = int(summary.get("steps") or 0), int(summary.get("epochs") or 0)
    t = cfg.train
    # Limits past where the run ended continue it from its last checkpoint (its MLflow run too),
    # as a longer schedule of the same run; the limits it reached are the keys the hint names.
    # A run that stopped early (train.early_stopping) is done whatever the limits.
    early = summary.get("stop_reason") if summary.get("early_stopped") else None
    reached = [
        key
        for key, hit in (
            ("train.max_steps", t.max_steps is not None and t.max_steps <= steps),
            ("train.max_epochs", t.epoch_limit <= epochs),
        )
        if hit
    ]
    if not early and not reached:
        return None
    newest = newest_manifest(folder)
    where = str(newest[0]) if newest else summary.get("checkpoint")
    tracked = f"MLflow run {summary['run_id']}" if summary.get("run_id") else "not tracked in MLflow"
    further = "" if early else f"raise {' and '.join(reached)} to train it further, or "
    line = (
        f"run {cfg.run.name}: already FINISHED at step {steps} (epoch {epochs}"
        f"{f'; {early}' if early else ''}); checkpoint {where}; {tracked}. Nothing to train: "
        f"{further}start a new run with --set run.name={fresh_name(cfg)}"
    )
    return Finished(line, summary)


def record_finished(folder: Path | None, summary: TrainSummary) -> None:
    """The driver, after a run FINISHED (its MLflow run closed): the record the next launch reads,
    in the run's `folder`."""
    if folder is None or summary.status != Status.FINISHED or not folder.is_dir():
        return
    tmp = folder / (RUN_RECORD + ".tmp")
    record = {"status": Status.FINISHED.value, "summary": summary.model_dump(mode="json", by_alias=True)}
    try:
        tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
        os.replace(tmp, folder / RUN_RECORD)  # whole or not at all: a torn record would hide the run's end
    except OSError as exc:
        log.warning("could not record run %s as finished in %s: %s", summary.run_name, folder, exc)


def closing_status(folder: Path | None, name: str | None, status: Status) -> Status:
    """The MLflow status a launch closes run `name` (in its `folder`) with. A run recorded FINISHED
    stays FINISHED whatever a later launch of it (a longer schedule) did: that launch's own outcome
    is its exit code and summary; the finished result is still there and must not read as lost."""
    if (
        status != Status.FINISHED
        and folder is not None
        and (read_record(folder) or {}).get("status") == Status.FINISHED
    ):
        log.warning("run %s: this launch ended %s; its MLflow run stays FINISHED (the earlier result)", name, status)
        return Status.FINISHED
    return status
