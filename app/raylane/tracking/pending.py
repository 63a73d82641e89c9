"""What the MLflow server did not take by the end of a launch, kept for the next launch of the run.

A server gone at the end of a run (restarted, its host rebooted) used to cost the run's end: the
metric values still buffered were dropped without a word and the MLflow run stayed RUNNING for
good, since a relaunch found the run FINISHED and had nothing to train. Now each writer of the
launch (rank 0's metric thread, the driver's records, its health watch, the run's close) writes
what it could not send into the run's folder, `<storage>/<run name>/mlflow_pending/`, one file
each (written whole, then renamed: the writers may be processes of their own), and the next
launch of the same run.name sends it first: the metric values at their own steps and times, the
tags, and the status the run ended with, which closes a run still RUNNING there
(raylane.tracking.runs.settle; a launch that trains further sends the values and closes the run
itself). A run on object storage has no folder here: what was not sent is counted, in one line.
Nothing here blocks a launch for long: each send is one MLflow call, bounded by MLflow's own HTTP
limits (raylane.tracking.runs.HTTP_ENV_DEFAULTS)."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("raylane.tracking")

FOLDER = "mlflow_pending"
BATCH = 1000  # MLflow's log_batch limit on metrics

# The run folder each MLflow run of this process keeps its unsent values in (set where the run
# is opened, and on the rank whose metric thread logs it).
_folders: dict[str, Path] = {}


def keep_for(run_id: str, run_folder: Path | None) -> None:
    """Unsent values of MLflow run `run_id` go to `run_folder` (None: object storage, nowhere)."""
    if run_folder is not None:
        _folders[run_id] = run_folder


def where(run_id: str) -> Path | None:
    """The folder unsent values of `run_id` are kept in, or None."""
    folder = _folders.get(run_id)
    return folder / FOLDER if folder is not None else None


def keep(
    run_id: str,
    tracking_uri: str,
    *,
    metrics: Iterable[tuple[str, float, int, int]] = (),
    tags: dict[str, str] | None = None,
    status: str | None = None,
) -> Path | None:
    """Write what the server did not take (metrics as (key, value, timestamp ms, step)), for the
    next launch; the file, or None when the run has no folder here or it cannot be written."""
    folder = where(run_id)
    if folder is None:
        return None
    record = {
        "run_id": run_id,
        "tracking_uri": tracking_uri,
        "metrics": [list(m) for m in metrics],
        "tags": tags or {},
        "status": status,
    }
    path = folder / f"{run_id}-{os.getpid()}-{time.time_ns()}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not keep what MLflow did not take in %s: %s", folder, exc)
        return None
    return path


def count(folder: Path | None, run_id: str) -> int:
    """The metric values kept in pending `folder` (see `where`) for MLflow run `run_id`."""
    if folder is None or not folder.is_dir():
        return 0
    return sum(len(run.metrics) for run in read(folder.parent) if run.run_id == run_id)


@dataclass
class Pending:
    """What the files of a run's folder hold, by MLflow run."""

    run_id: str
    tracking_uri: str
    files: list[Path]
    metrics: list[tuple[str, float, int, int]]
    tags: dict[str, str]
    status: str | None  # the last launch's end, when its close was not taken


def read(run_folder: Path | None) -> list[Pending]:
    """Everything kept in `run_folder`, by MLflow run (an unreadable file is left where it is)."""
    folder = run_folder / FOLDER if run_folder is not None else None
    if folder is None or not folder.is_dir():
        return []
    runs: dict[str, Pending] = {}
    for path in sorted(folder.glob("*.json")):  # by name: a run's files in the order written
        try:
            record = json.loads(path.read_text())
            run = runs.setdefault(record["run_id"], Pending(record["run_id"], record["tracking_uri"], [], [], {}, None))
            run.files.append(path)
            run.metrics += [(str(k), float(v), int(ts), int(step)) for k, v, ts, step in record["metrics"]]
            run.tags.update(record["tags"])
            run.status = record["status"] or run.status
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("could not read %s (left there): %s", path, exc)
    return list(runs.values())


def send(run: Pending, client_for: Callable[[str], Any], *, close: bool) -> None:
    """Send `run`'s kept values (and, with `close`, its status, when it is still RUNNING there),
    then remove its files; raises what MLflow raises, the files left for a later launch."""
    from mlflow.entities import Metric, RunTag

    client = client_for(run.tracking_uri)
    for i in range(0, len(run.metrics), BATCH):
        chunk = run.metrics[i : i + BATCH]
        client.log_batch(run.run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in chunk])
    if run.tags:
        client.log_batch(run.run_id, tags=[RunTag(k, v) for k, v in run.tags.items()])
    if close and run.status and client.get_run(run.run_id).info.status == "RUNNING":
        client.set_terminated(run.run_id, status=run.status)
    for path in run.files:
        path.unlink(missing_ok=True)


def send_all(run_folder: Path | None, client_for: Callable[[str], Any], *, close: bool) -> tuple[int, list[str]]:
    """Send everything kept in `run_folder` (see `send`): (metric values sent, "RUN_ID STATUS" of
    each MLflow run closed); raises what MLflow raises, the rest left for a later launch."""
    sent, closed = 0, []
    for run in read(run_folder):
        send(run, client_for, close=close)
        sent += len(run.metrics)
        if close and run.status:
            closed.append(f"{run.run_id} {run.status}")
    return sent, closed


def settle(run_folder: Path | None, name: str, client_for: Callable[[str], Any]) -> str | None:
    """Send and close what earlier launches of run `name` kept (a launch with nothing to train);
    the line that says so, or None when nothing was kept."""
    if run_folder is None or not read(run_folder):
        return None
    try:
        sent, closed = send_all(run_folder, client_for, close=True)
    except Exception as exc:  # noqa: BLE001 - still kept: the next launch tries again
        return f"MLflow still does not take what run {name} kept for it ({cause(exc)}): kept in {run_folder / FOLDER}"
    ended = f"MLflow run {', '.join(closed)} closed" if closed else f"run {name}'s MLflow run"
    return f"{ended}, with the {sent} metric value{'s' * (sent != 1)} an earlier launch could not send"


def cause(exc: BaseException) -> str:
    """MLflow's error in a few words: its errno's text when there is one (a refused or timed-out
    connection; its message runs to hundreds of characters of retries and URLs)."""
    errno = re.search(r"\[Errno -?\d+\] ([^\"')]+)", str(exc))
    return errno.group(1).strip() if errno else f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
