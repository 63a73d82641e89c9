"""MLflow: the driver owns the run's life (create or continue, params, terminal status); rank 0
logs metrics through `MetricLogger`, a background thread that batches, so logging never stalls a
step and a slow or absent tracking server never crashes training. The experiment the runs are in,
as MLflow's UI shows it: raylane.tracking.experiment."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raylane.config import BaseConfig
from raylane.tracking import pending
from raylane.tracking.experiment import experiment_url, table_metrics, use_experiment
from raylane.version import __version__

log = logging.getLogger("raylane.tracking")

RUN_NAME_TAG = "raylane.run_name"
ERROR_TAG = "raylane.error"  # why the run's last launch failed or stopped: its one line
MAX_TAG_VALUE_LEN = 5000  # MLflow's limit on a tag's value (8,000 in 3.x; 5,000 in older servers)
MAX_PARAMS_PER_BATCH = 100  # MLflow's log_batch limits
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE_LEN = 6000
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # MLflow's own default


# MLflow's HTTP client retries 7 times with exponential backoff (minutes) by default. Our metric
# thread retries every flush anyway, and the driver must not hang on an unreachable server.
HTTP_ENV_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


def resolve_tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else MLflow's default (sqlite:///mlflow.db), with sqlite paths made
    absolute: Ray workers do not share the driver's working directory."""
    for key, value in HTTP_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)  # inherited by Ray workers started after this
    return absolute_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI)


def absolute_tracking_uri(uri: str) -> str:
    """`uri` with a relative local store (a sqlite file, a file store: `mlruns`, `file:mlruns`)
    made absolute, against this process's working directory."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return Path(uri[len("file:") :]).resolve().as_uri()
    if ":" not in uri and not uri.startswith("databricks"):  # a plain path: MLflow's file store
        return Path(uri).expanduser().resolve().as_uri()
    return uri


def local_store(uri: str) -> bool:
    """A tracking URI that names a file (sqlite, a file store) rather than a server."""
    scheme = uri.split(":", 1)[0] if ":" in uri else ""
    return scheme in ("sqlite", "file") or (not scheme and not uri.startswith("databricks"))


def ui_command(tracking_uri: str, handle: RunHandle | None = None) -> str:
    """How to see the results: the server's address, or the `mlflow ui` command for a database;
    with a run, the link to its experiment's runs in the model-training view (experiment_url)."""
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {experiment_url(tracking_uri, handle.experiment_id) if handle else tracking_uri}"
    mlflow_bin = Path(os.sys.prefix) / "bin" / "mlflow"
    command = f"{mlflow_bin} ui --backend-store-uri {tracking_uri} --host 127.0.0.1 --port 5000"
    if handle is None:
        return command
    return f"{command}, then open {experiment_url('http://127.0.0.1:5000', handle.experiment_id)}"


def git_commit(cwd: str | None = None) -> str | None:
    """The commit of the code being run, when it runs from a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def ray_job_submission_id() -> str | None:
    """The Ray job's submission id when this driver runs as a `ray job submit` entrypoint (the
    job supervisor hands the entrypoint its metadata through this variable)."""
    import json

    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    except ValueError:
        return None
    return (config.get("metadata") or {}).get("job_submission_id")


def run_tags(cfg: BaseConfig, world_size: int) -> dict[str, str]:
    """What a run is, for filtering in the UI: known before any worker starts."""
    world = world_size
    tags = {
        RUN_NAME_TAG: cfg.run.name,
        "raylane.pipeline": cfg.pipeline,
        "raylane.version": __version__,
        # What was asked; rank 0 replaces it with what was chosen (auto) once it is known.
        "raylane.strategy": cfg.strategy.name if world > 1 else "single",
        "raylane.world_size": str(world),
        "raylane.backend": "nccl" if cfg.scaling.use_gpu else ("gloo" if world > 1 else "none"),
        "raylane.device_type": "cuda" if cfg.scaling.use_gpu else "cpu",
    }
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    if job_id := ray_job_submission_id():
        tags["raylane.ray_job_id"] = job_id
    return tags


@dataclass
class RunHandle:
    run_id: str
    experiment_id: str
    tracking_uri: str
    resumed: bool
    run_name: str | None = None  # raylane's run.name


def mlflow_client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    if tracking_uri.startswith("sqlite:///"):
        _sqlite_ready(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


@functools.cache
def _sqlite_ready(tracking_uri: str) -> None:
    """Once per process: the database exists with MLflow's tables. Two runs started together on a
    new database both created them, and one failed ("duplicate column name") and trained
    untracked: the first query, which creates them, runs one process at a time."""
    import fcntl

    from mlflow.tracking import MlflowClient

    with open(f"{tracking_uri[len('sqlite:///') :]}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        MlflowClient(tracking_uri=tracking_uri).search_experiments(max_results=1)


def open_run(cfg: BaseConfig, tracking_uri: str, world_size: int, folder: Path | None) -> RunHandle:
    """Create the run for `cfg.run.name`, or continue the one a previous launch of it opened;
    what MLflow does not take is kept in the run's `folder` (raylane.runrecord.run_folder)."""
    client = mlflow_client(tracking_uri)
    exp_id = use_experiment(client, cfg.mlflow.experiment, table_metrics(cfg))
    found = client.search_runs(
        [exp_id],
        filter_string=f"tags.`{RUN_NAME_TAG}` = '{cfg.run.name}'",
        max_results=1,
        order_by=["attributes.start_time DESC"],
    )
    all_tags = run_tags(cfg, world_size)
    if found:
        run_id = found[0].info.run_id
        pending.send_all(folder, mlflow_client, close=False)  # this launch closes the run itself
        client.update_run(run_id, status="RUNNING")
        if ERROR_TAG in found[0].data.tags:  # an earlier launch's failure: this one may end otherwise
            client.delete_tag(run_id, ERROR_TAG)
        known = found[0].data.params
    else:
        run_id = client.create_run(exp_id, run_name=cfg.run.name, tags=all_tags).info.run_id
        known = {}
    from mlflow.entities import Param, RunTag

    # MLflow forbids changing a logged param: a resumed run keeps its first values.
    params = [Param(k, str(v)[:MAX_PARAM_VALUE_LEN]) for k, v in cfg.flat().items() if k not in known]
    for i in range(0, len(params), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[i : i + MAX_PARAMS_PER_BATCH])
    client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in all_tags.items()])
    pending.keep_for(run_id, folder)
    return RunHandle(run_id, exp_id, tracking_uri, resumed=bool(found), run_name=cfg.run.name)


def settle(cfg: BaseConfig, folder: Path | None) -> str | None:
    """For a launch with nothing to train (the run FINISHED): close the MLflow run an earlier launch
    could not close (its server was gone at the end), with what it could not send (kept in the
    run's `folder`); the line that says so, or None when nothing was kept (raylane.tracking.pending)."""
    return pending.settle(folder, str(cfg.run.name), mlflow_client)


def close_run(handle: RunHandle, status: str, error: str | None = None) -> None:
    """FINISHED, FAILED or KILLED: a run is never left RUNNING. `error`: the one line the launch
    ended with (the terminal's), tagged `raylane.error`, so that the UI says why a run failed.
    What the server does not take is kept for the run's next launch (raylane.tracking.pending),
    and one line says so."""
    tags = {ERROR_TAG: error[:MAX_TAG_VALUE_LEN]} if error else {}
    run_id, name = handle.run_id, handle.run_name
    try:
        client = mlflow_client(handle.tracking_uri)
        if tags:
            client.set_tag(run_id, ERROR_TAG, tags[ERROR_TAG])
        client.set_terminated(run_id, status=status)
    except Exception as exc:  # the result is on disk already; do not turn success into a crash
        kept = pending.keep(run_id, handle.tracking_uri, tags=tags, status=status)
        if kept is None:
            log.warning(
                "could not mark MLflow run %s %s (%s): it stays RUNNING there", run_id, status, pending.cause(exc)
            )
            return
        values = pending.count(kept.parent, run_id)
        log.warning(
            "MLflow at %s did not take the end of run %s (%s): it shows RUNNING there until the next launch of "
            "run.name=%s sends its status %s%s, kept in %s",
            handle.tracking_uri, run_id, pending.cause(exc), name, status,
            f" and the {values} metric values it did not take" if values else "", kept.parent,
        )  # fmt: skip
        return
    if values := pending.count(pending.where(run_id), run_id):
        log.warning(
            "MLflow did not take %d metric values of run %s: kept in %s, sent by the next launch of run.name=%s",
            values, run_id, pending.where(run_id), name,
        )  # fmt: skip


def rank_zero_logger(cfg: BaseConfig, tracking_uri: str, run_id: str, folder: Path | None) -> MetricLogger:
    pending.keep_for(run_id, folder)  # the run's folder, on a Ray worker too: its unsent values go there
    m = cfg.mlflow
    return MetricLogger(
        tracking_uri, run_id, system_metrics_interval_s=m.system_metrics_interval_s if m.system_metrics else None
    )


def logged_steps(client, run_id: str) -> dict[str, int]:
    """The highest step each metric of the run has a point at (MLflow keeps each metric's latest)."""
    return {m.key: m.step for m in client.get_run(run_id).data.to_proto().metrics}


class MetricLogger:
    """Rank 0's metric sink: `log()` only appends to a bounded buffer; a thread sends batches.

    A point at a step the run already has a point of that metric at, or before, is not sent: a
    launch that resumes from an older checkpoint than the last one logged (the newest was
    damaged) trains those steps again, and MLflow would show two points at each of them."""

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        *,
        flush_interval_s: float = 5.0,
        max_buffered: int = 100_000,
        system_metrics_interval_s: float | None = None,
    ) -> None:
        self.tracking_uri, self.run_id = tracking_uri, run_id
        self.flush_interval_s = flush_interval_s
        # Only _flush pops, from the left, what it has sent; log() refuses values when full.
        self._buffer: deque[tuple[str, float, int, int]] = deque()
        self._max_buffered = max_buffered
        self._dropped = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._warned = False
        self._failure: Exception | None = None  # the last flush's error
        self._tags: dict[str, str] = {}
        self._first: dict[str, str] = {}  # set_first_tags'
        self._logged: dict[str, int] | None = None  # logged_steps() when this logger started
        self._system_metrics_interval_s = system_metrics_interval_s
        self._monitor = None
        # What logging costs rank 0, for the overhead benchmark: time inside log() on the
        # training thread, and CPU time of the two background threads.
        self._log_call_s = 0.0
        self._thread_cpu_s = 0.0
        self._monitor_cpu_s = 0.0
        # mlflow's import (~1.5 s) happens on this thread, off the training path; set once it has.
        self.ready = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raylane-mlflow", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        started = time.perf_counter()
        now_ms = int(time.time() * 1000)
        with self._lock:
            for key, value in metrics.items():
                if len(self._buffer) >= self._max_buffered:
                    self._dropped += 1
                    continue
                self._buffer.append((key, float(value), now_ms, step))
        self._log_call_s += time.perf_counter() - started

    def cost(self) -> dict[str, float]:
        """Seconds logging took from rank 0 (after close): on the training thread, and CPU time of
        the sender and system-metrics threads. On busy cores, their sum bounds the slowdown."""
        return {
            "log_calls_s": self._log_call_s,
            "sender_cpu_s": self._thread_cpu_s,
            "system_metrics_cpu_s": self._monitor_cpu_s,
        }

    def set_tags(self, tags: dict[str, Any]) -> None:
        with self._lock:
            self._tags.update({k: str(v) for k, v in tags.items()})

    def set_first_tags(self, tags: dict[str, Any]) -> None:
        """Tags that a run keeps as first set: one the run has already (an earlier group of the
        run, restarted since, named the same straggler) keeps its value. Read from the run before
        they are sent, on this logger's thread."""
        with self._lock:
            self._first.update({k: str(v) for k, v in tags.items()})

    def _loop(self) -> None:
        try:
            client = mlflow_client(self.tracking_uri)
            if self._system_metrics_interval_s:
                self._start_system_metrics()
        finally:
            self.ready.set()
        while not self._stop.wait(self.flush_interval_s):
            self._flush(client)
        self._flush(client)
        self._thread_cpu_s = time.thread_time()

    def _start_system_metrics(self) -> None:
        """MLflow's own sampler (CPU, memory, disk, network; GPUs through NVML), on this node."""
        try:
            import mlflow
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            mlflow.set_tracking_uri(self.tracking_uri)
            interval = self._system_metrics_interval_s
            self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=interval, samples_before_logging=1)
            self._monitor.start()
        except Exception as exc:  # noqa: BLE001 - a missing sampler must not stop training
            log.warning("MLflow system metrics are off: %s", exc)

    def _flush(self, client) -> None:
        from mlflow.entities import Metric, RunTag

        with self._lock:
            tags, self._tags = self._tags, {}
            first, self._first = self._first, {}
        if first:
            try:
                had = client.get_run(self.run_id).data.tags
                tags = {**{k: v for k, v in first.items() if k not in had}, **tags}
            except Exception:  # noqa: BLE001 - retried at the next flush
                with self._lock:
                    self._first = {**first, **self._first}
        if tags:
            try:
                client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
            except Exception:  # noqa: BLE001 - retried at the next flush
                with self._lock:
                    self._tags = {**tags, **self._tags}
        if not self._drop_logged(client):
            return
        with self._lock:
            buffered = list(self._buffer)
        for i in range(0, len(buffered), MAX_METRICS_PER_BATCH):
            chunk = buffered[i : i + MAX_METRICS_PER_BATCH]
            try:
                client.log_batch(self.run_id, metrics=[Metric(k, v, ts, s) for k, v, ts, s in chunk])
            except Exception as exc:  # keep the rest buffered; training goes on
                self._failure = exc
                if not self._warned:
                    log.warning("MLflow logging failed (%s): metrics stay buffered", pending.cause(exc))
                    self._warned = True
                return
            if self._warned:
                log.warning("MLflow logging works again: buffered metrics sent")
                self._warned = False
            with self._lock:
                for _ in chunk:
                    self._buffer.popleft()

    def _drop_logged(self, client) -> bool:
        """Drop the buffered points at steps the run already had; False while the run cannot be
        read (nothing is sent until it can)."""
        if self._logged is None:
            try:
                self._logged = logged_steps(client, self.run_id)
            except Exception as exc:  # noqa: BLE001 - retried at the next flush, as sending is
                self._failure = exc
                return False
        if self._logged:
            with self._lock:
                kept = [m for m in self._buffer if m[3] > self._logged.get(m[0], -1)]
                if len(kept) < len(self._buffer):
                    self._buffer = deque(kept)
                # Steps only grow: once training is past every step logged before, no later point
                # can repeat one, and the filter (a pass over the buffer under the lock) ends.
                if self._buffer and self._buffer[-1][3] > max(self._logged.values()):
                    self._logged = {}
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if self._monitor is not None:
            self._monitor_cpu_s = _thread_cpu_s(getattr(self._monitor, "_process", None))
            try:
                self._monitor.finish()
            except Exception:  # noqa: BLE001
                pass
        if self._dropped:
            log.warning("MLflow buffer was full: %d metric values were dropped", self._dropped)
        self._keep_unsent()

    def _keep_unsent(self) -> None:
        """What the server has not taken by now is kept for the run's next launch (the run's close
        says so, in one line with its own: raylane.tracking.runs.close_run), or counted as dropped
        where the run has no folder (object storage)."""
        if self._thread.is_alive():  # still sending, past close's wait: what it sends is not kept twice
            log.warning(
                "MLflow: run %s's metric thread still sends %d values as this launch ends",
                self.run_id,
                len(self._buffer),
            )
            return
        with self._lock:
            unsent, tags = list(self._buffer), dict(self._tags)
            self._buffer.clear()
            self._tags = {}
        if not unsent and not tags:
            return
        if pending.keep(self.run_id, self.tracking_uri, metrics=unsent, tags=tags) is None:
            cause = f" ({pending.cause(self._failure)})" if self._failure else ""
            log.warning(
                "MLflow did not take %d metric values of run %s%s: dropped (no run folder to keep them in)",
                len(unsent), self.run_id, cause,
            )  # fmt: skip


def _thread_cpu_s(thread: threading.Thread | None) -> float:
    """CPU seconds a live thread of this process has used (0 when unknown)."""
    import psutil

    tid = getattr(thread, "native_id", None)
    for t in psutil.Process().threads():
        if t.id == tid:
            return t.user_time + t.system_time
    return 0.0
