"""Every node's health, sampled where the ranks run: one sampler per node (the rank with local rank
0), a daemon thread that every `interval_s` reads the node's CPU, memory, disk, network and GPUs
and rewrites one small JSON file, `<run folder>/health/<node>.json`, holding its last few samples. The driver reads
those files and records them in MLflow (raylane.tracking.health): the run folder is the channel
every rank already shares (checkpoints need it), so no collective is made and nothing waits on a
step; only rank 0's process talks to MLflow, as before.

Nothing here imports torch or Ray: GPUs are read through NVML (pynvml) where it loads, and their
fields are left out where it does not."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from raylane.loop.distributed.groups import node_name

log = logging.getLogger("raylane")

HEALTH = "health"  # the run folder's subfolder
KEEP = 5  # samples each node's file holds: a reader that polls late still sees each once
GB = 1024**3
MB = 1024**2


def file_name(node: str) -> str:
    """A node's health file: its name with anything but letters, digits, `.`, `_` and `-` as `_`."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in node) + ".json"


class Gpus:
    """The node's GPUs through NVML; `count` is 0 where NVML is not there (no driver, no pynvml)."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no GPU, no driver or no pynvml: CPU and memory only
            self.handles = []

    @property
    def count(self) -> int:
        return len(self.handles)

    def read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, h in enumerate(self.handles):
            out.update(_one_gpu(self.nvml, h, f"gpu{i}_"))
        return out


def _one_gpu(nvml: Any, handle: Any, prefix: str) -> dict[str, float]:
    """A GPU's fields; one NVML call that fails (power is not readable on every board) leaves out its field."""
    reads: dict[str, Callable[[], float]] = {
        "utilization_percent": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
        "memory_used_gb": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used / GB,
        "memory_percent": lambda: 100 * _ratio(nvml.nvmlDeviceGetMemoryInfo(handle)),
        "power_w": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
        "temperature_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
    }
    out: dict[str, float] = {}
    for field, read in reads.items():
        try:
            out[prefix + field] = round(float(read()), 3)
        except Exception:  # noqa: BLE001 - a field this board does not report
            pass
    return out


def _ratio(info: Any) -> float:
    return info.used / info.total if info.total else 0.0


class DiskAndNetwork:
    """The node's disk that holds `path` (the run's folder where it is on this node, else `/`): its
    use and free space; and its network, every interface but loopback (traffic inside the node),
    in MB/s received and sent since the previous `read` (or since this was made)."""

    def __init__(self, path: str = os.sep) -> None:
        while path and not os.path.exists(path):  # the run's folder may not be made yet
            path = os.path.dirname(path.rstrip(os.sep)) or os.sep
        self.path = path or os.sep
        self._net = self._counters()

    @staticmethod
    def _counters() -> tuple[float, int, int]:
        import psutil

        nics = psutil.net_io_counters(pernic=True) or {}
        outward = [c for nic, c in nics.items() if not (nic == "lo" or nic.startswith("lo") and nic[2:].isdigit())]
        return time.monotonic(), sum(c.bytes_recv for c in outward), sum(c.bytes_sent for c in outward)

    def read(self) -> dict[str, float]:
        import psutil

        out: dict[str, float] = {}
        try:
            disk = psutil.disk_usage(self.path)
            out.update(disk_percent=disk.percent, disk_free_gb=round(disk.free / GB, 3))
        except OSError:  # the folder's mount went away: the other fields still come
            pass
        (then, rx0, tx0), (now, rx, tx) = self._net, self._counters()
        self._net = (now, rx, tx)
        seconds = max(now - then, 1e-3)
        # A counter that went back (an interface reset) reads as 0, not as a negative rate.
        out["network_receive_mb_s"] = round(max(rx - rx0, 0) / MB / seconds, 3)
        out["network_transmit_mb_s"] = round(max(tx - tx0, 0) / MB / seconds, 3)
        return out


def read_sample(gpus: Gpus | None = None, io: DiskAndNetwork | None = None) -> dict[str, float]:
    """This node's CPU (percent of all cores since the previous call), memory, disk and network
    (`io`) and GPUs, now."""
    import psutil

    memory = psutil.virtual_memory()
    sample = {
        "cpu_percent": psutil.cpu_percent(interval=None),
        "memory_percent": memory.percent,
        "memory_used_gb": round((memory.total - memory.available) / GB, 3),
    }
    return {**sample, **(io.read() if io else {}), **(gpus.read() if gpus else {})}


class HealthSampler:
    """Samples this node every `interval_s` on a daemon thread and writes its last KEEP samples,
    each with its time (`t`, unix seconds) and number (`n`), to `folder/<node>.json` through `fs`
    (a pyarrow filesystem: local, shared or s3://). A write that fails is retried at the next
    sample; one that hangs leaves the node silent, which the driver names."""

    def __init__(self, fs: Any, folder: str, node: str, interval_s: float) -> None:
        self.fs, self.folder, self.node, self.interval_s = fs, folder.rstrip("/"), node, interval_s
        self.path = f"{self.folder}/{file_name(node)}"
        import pyarrow.fs as pafs

        self.io = DiskAndNetwork(self.folder if isinstance(fs, pafs.LocalFileSystem) else os.sep)
        self.samples: deque[dict[str, Any]] = deque(maxlen=KEEP)
        self._stop = threading.Event()
        self._warned = False
        self._made = False  # the folder, once
        self._thread = threading.Thread(target=self._run, name="raylane-health", daemon=True)

    def start(self) -> HealthSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        import psutil

        psutil.cpu_percent(interval=None)  # the first reading is since this one
        gpus = Gpus()
        n = 0
        # The first sample after a second, not a whole interval: a short run still records one.
        while not self._stop.wait(min(1.0, self.interval_s) if n == 0 else self.interval_s):
            self.sample_once(gpus, n)
            n += 1

    def sample_once(self, gpus: Gpus | None = None, n: int = 0) -> dict[str, Any]:
        sample = {"t": round(time.time(), 3), "n": n, **read_sample(gpus, self.io)}
        self.samples.append(sample)
        try:
            self._write()
            self._warned = False
        except Exception as exc:  # noqa: BLE001 - health is best effort: training goes on without it
            if not self._warned:
                log.warning("health of node %s not written to %s: %s", self.node, self.path, exc)
                self._warned = True
        return sample

    def _write(self) -> None:
        import pyarrow.fs as pafs

        body = json.dumps({"node": self.node, "interval_s": self.interval_s, "samples": list(self.samples)}).encode()
        if not self._made:
            self.fs.create_dir(self.folder, recursive=True)
            self._made = True
        # Whole or not at all: a reader never sees half a file (a put to object storage is whole anyway).
        target = f"{self.path}.tmp" if isinstance(self.fs, pafs.LocalFileSystem) else self.path
        with self.fs.open_output_stream(target) as out:
            out.write(body)
        if target != self.path:
            self.fs.move(target, self.path)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def start_sampler(cfg: Any, local_rank: int, store: Any) -> HealthSampler | None:
    """This node's sampler, on the rank with local rank 0 when the run records system metrics
    (mlflow.enabled and mlflow.system_metrics), writing into the run's folder (`store`'s); else None."""
    m = cfg.mlflow
    if local_rank != 0 or not (m.enabled and m.system_metrics):
        return None
    return HealthSampler(store.fs, f"{store.root}/{HEALTH}", node_name(), m.system_metrics_interval_s).start()
