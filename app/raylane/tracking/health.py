"""Every node's health in MLflow: the driver reads the files each node's sampler rewrites in the
run's folder (`<storage_path>/<run.name>/health/<node>.json`: raylane.loop.observe.health) every
`mlflow.system_metrics_interval_s`, and logs each sample not logged yet as `system/<node>/<field>`
(cpu_percent, memory_percent, memory_used_gb, disk_percent, disk_free_gb, network_receive_mb_s,
network_transmit_mb_s; per GPU gpu<i>_utilization_percent,
gpu<i>_memory_percent, gpu<i>_memory_used_gb, gpu<i>_power_w, gpu<i>_temperature_c), at step =
the sample's unix second, for runs of up to MAX_NODE_SERIES nodes. On more, the keys would grow
with the nodes and their GPUs, so with the ranks (6,016 values an interval at 1,024 GPUs, bench
B15): each interval is then one set of figures over the nodes, whatever their number:
`system/nodes/<field>_min`, `_median` and `_max` (a GPU's fields over every GPU: `gpu_<field>`),
and `system/nodes/reporting`, the nodes whose sample it covers. Each node's last samples stay in
its file in the run's folder.

A node whose file has not changed for `mlflow.system_metrics_silent_after` intervals, as the
driver's own clock sees it (the nodes' clocks need not agree), is named once: a warning on the
terminal and the run's tag `raylane.node_silent.<node>`, for MAX_SILENT_NAMED nodes; past them
(a rack lost), one tag and one line count the others."""

from __future__ import annotations

import json
import logging
import re
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from raylane.loop.observe.health import HEALTH, file_name

log = logging.getLogger("raylane")

SILENT_TAG = "raylane.node_silent."
MAX_NODE_SERIES = 8  # nodes recorded one by one; on more, figures over the nodes
MAX_SILENT_NAMED = 8  # silent nodes named one by one (a tag and a line each); then counted
MORE_SILENT_TAG = "raylane.nodes_silent_more"
_GPU = re.compile(r"^gpu\d+_")


def metric_key(node: str, field: str) -> str:
    """`system/<node>/<field>`, the node's name kept to what MLflow accepts in a key."""
    safe = "".join(c if c.isalnum() or c in "._- :" else "_" for c in node)
    return f"system/{safe}/{field}"


class HealthWatch:
    """Reads the nodes' health files in `folder` (through the pyarrow filesystem `fs`); `poll()`
    logs the new samples through `log_metrics(metrics, step)` and names a silent node through
    `set_tags`. `clock` (monotonic seconds) is the driver's: a test gives a fake one."""

    def __init__(
        self,
        fs: Any,
        folder: str,
        interval_s: float,
        silent_after: int,
        log_metrics: Callable[[dict[str, float], int], None],
        set_tags: Callable[[dict[str, str]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fs, self.folder, self.interval_s, self.silent_after = fs, folder.rstrip("/"), interval_s, silent_after
        self._log, self._tags, self._clock = log_metrics, set_tags, clock
        self.last_logged: dict[str, float] = {}  # node -> its newest sample's time logged (the node's clock)
        self.heard: dict[str, float] = {}  # node -> when its file last had a new sample (the driver's clock)
        self.silent: dict[str, str] = {}  # node -> the line that named it
        self._before: dict[str, float] | None = None  # node -> its newest sample at the first poll
        self._newest_heard: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        now = self._clock()
        found = self._read()
        if self._before is None:
            # Files an earlier launch of this run left: logged (MLflow keeps no point twice), but a
            # node is watched for silence only once it writes during this launch.
            self._before = {node: _newest(samples) for node, samples in found.items()}
        fresh = {
            n: samples for n, samples in found.items() if _newest(samples) > self.last_logged.get(n, float("-inf"))
        }
        self._record_all(fresh, nodes=len(found))
        for node, samples in found.items():
            newest = _newest(samples)
            if newest > max(self._before.get(node, float("-inf")), self._newest_heard.get(node, float("-inf"))):
                self._newest_heard[node] = newest
                self.heard[node] = now
        for node, heard in self.heard.items():
            quiet = now - heard
            if node not in self.silent and quiet > self.silent_after * self.interval_s:
                self._name_silent(node, quiet)

    def _record(self, node: str, samples: list[dict[str, Any]]) -> None:
        since = self.last_logged.get(node, float("-inf"))
        for sample in sorted(samples, key=lambda s: s.get("t", 0.0)):
            t = sample.get("t", 0.0)
            if t <= since:
                continue
            fields = _fields(sample)
            self._log({metric_key(node, k): v for k, v in fields.items()}, int(t))
            self.last_logged[node] = t

    def _record_all(self, fresh: dict[str, list[dict[str, Any]]], nodes: int) -> None:
        """The new samples of each node, or, past MAX_NODE_SERIES nodes, figures over the nodes."""
        if nodes <= MAX_NODE_SERIES:
            for node, samples in fresh.items():
                self._record(node, samples)
        elif fresh:
            self._record_over_nodes(fresh)

    def _record_over_nodes(self, fresh: dict[str, list[dict[str, Any]]]) -> None:
        """Min, median and max of each field over the newest sample of each node that sent one
        (a GPU's over every GPU), at the newest one's second: as many keys whatever the nodes."""
        values: dict[str, list[float]] = {}
        at = 0.0
        for node, samples in fresh.items():
            sample = max(samples, key=lambda s: s.get("t", 0.0))
            at = max(at, float(sample.get("t", 0.0)))
            for k, v in _fields(sample).items():
                values.setdefault(_GPU.sub("gpu_", k), []).append(v)
            self.last_logged[node] = _newest(samples)
        metrics = {"system/nodes/reporting": float(len(fresh))}
        for field, vs in values.items():
            metrics.update(
                {f"system/nodes/{field}_min": min(vs), f"system/nodes/{field}_median": statistics.median(vs),
                 f"system/nodes/{field}_max": max(vs)}
            )  # fmt: skip
        self._log(metrics, int(at))

    def _name_silent(self, node: str, quiet: float) -> None:
        if len(self.silent) >= MAX_SILENT_NAMED:
            self.silent[node] = ""
            more = len(self.silent) - MAX_SILENT_NAMED
            self._tags({MORE_SILENT_TAG: str(more)})
            if more in (1, 10, 100, 1000):  # a line now and then, not one per node
                log.warning("%d more nodes have sent no health sample for %.0f s", more, quiet)
            return
        line = (
            f"node {node} has sent no health sample for {quiet:.0f} s ({self.silent_after} intervals of "
            f"{self.interval_s:g} s; mlflow.system_metrics_silent_after): it may be down, hung or cut off "
            "from the run's folder"
        )
        self.silent[node] = line
        log.warning("%s", line)
        self._tags({SILENT_TAG + file_name(node).removesuffix(".json"): line})

    def _read(self) -> dict[str, list[dict[str, Any]]]:
        """Each node's samples, by the node's name; a file being replaced or unreadable is skipped
        (read again at the next poll)."""
        import pyarrow.fs as pafs

        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.folder, allow_not_found=True))
        except OSError:
            return {}
        out: dict[str, list[dict[str, Any]]] = {}
        for info in infos:
            if info.type != pafs.FileType.File or not info.base_name.endswith(".json"):
                continue
            try:
                with self.fs.open_input_stream(info.path) as f:
                    data = json.loads(f.read())
                out[str(data["node"])] = list(data["samples"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return out

    def start(self) -> HealthWatch:
        self._thread = threading.Thread(target=self._run, name="raylane-health-watch", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - the watch is best effort: training goes on without it
                log.debug("health watch: %s", exc)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop, after one last read: the samples the nodes wrote before the ranks ended."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        try:
            self._record_last()
        except Exception as exc:  # noqa: BLE001
            log.debug("health watch: %s", exc)

    def _record_last(self) -> None:
        found = self._read()
        fresh = {
            n: samples for n, samples in found.items() if _newest(samples) > self.last_logged.get(n, float("-inf"))
        }
        self._record_all(fresh, nodes=len(found))


def _fields(sample: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in sample.items() if k not in ("t", "n") and isinstance(v, (int, float))}


def _newest(samples: list[dict[str, Any]]) -> float:
    return max((float(s.get("t", 0.0)) for s in samples), default=0.0)


def start_watch(cfg: Any, tracking_uri: str, run_id: str) -> tuple[HealthWatch, Any] | None:
    """The driver's watch over the run's health folder, logging through a MetricLogger of its own;
    None when the run records no system metrics. Stop both with `stop_watch`."""
    if not (cfg.mlflow.enabled and cfg.mlflow.system_metrics):
        return None
    from raylane.loop.checkpoint.storage import filesystem_for
    from raylane.tracking.runs import MetricLogger

    fs, root = filesystem_for(cfg.run.storage_path)
    logger = MetricLogger(tracking_uri, run_id)
    m = cfg.mlflow
    folder = f"{root.rstrip('/')}/{cfg.run.name}/{HEALTH}"
    watch = HealthWatch(
        fs, folder, m.system_metrics_interval_s, m.system_metrics_silent_after, logger.log, logger.set_tags
    )
    watch.poll()  # what is there before this launch's ranks start
    return watch.start(), logger


def stop_watch(watching: tuple[HealthWatch, Any] | None) -> None:
    if watching is not None:
        watch, logger = watching
        watch.stop()
        logger.close()
