"""Every node's health (issue 51, item 4), in-process: a node's sampler reads this machine's real
CPU and memory and writes its last samples to the run's folder; the driver's watch logs each
sample once, under `system/<node>/...`, and names a node whose file stops changing once (a fake
clock). Two nodes' samplers under torchrun, recorded in MLflow: tests/e2e/test_health.py."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest

from raylane.config import BaseConfig
from raylane.loop.observe import health
from raylane.loop.observe.health import KEEP, HealthSampler, start_sampler
from raylane.tracking.health import SILENT_TAG, HealthWatch, metric_key


def test_a_sampler_reads_this_machine_and_keeps_its_last_samples(tmp_path):
    sampler = HealthSampler(pafs.LocalFileSystem(), str(tmp_path / "health"), "node a", 10.0)
    for n in range(KEEP + 2):
        sampler.sample_once(health.Gpus(), n)
    data = json.loads((tmp_path / "health" / "node_a.json").read_text())
    assert data["node"] == "node a" and data["interval_s"] == 10.0
    assert [s["n"] for s in data["samples"]] == list(range(2, KEEP + 2))  # the file stays small
    last = data["samples"][-1]
    assert 0 <= last["cpu_percent"] <= 100 and 0 < last["memory_percent"] < 100 and last["memory_used_gb"] > 0
    # The disk that holds the run's folder, and the network (issue 60, finding 10: on Ray, MLflow's
    # own disk and network metrics never came; now every node's sampler reads them).
    disk = shutil.disk_usage(tmp_path)
    assert 0 < last["disk_percent"] < 100 and abs(last["disk_free_gb"] - disk.free / 1024**3) < 1
    assert last["network_receive_mb_s"] >= 0 and last["network_transmit_mb_s"] >= 0
    assert not [k for k in last if k.startswith("gpu")]  # no NVML GPU here: no GPU fields
    assert [p.name for p in (tmp_path / "health").iterdir()] == ["node_a.json"]  # no .tmp left


def test_the_network_rate_leaves_out_loopback_and_a_counter_reset(monkeypatch, tmp_path):
    """The counters are the kernel's (psutil): this sandbox sends nothing outward, so they are
    given here. 10 MB in and 5 MB out on eth0 over 2 s, loopback's traffic left out; then a counter
    that went back (an interface reset) reads 0, not a negative rate."""
    import psutil

    nic = SimpleNamespace
    readings = iter(
        [
            (100.0, {"lo": nic(bytes_recv=0, bytes_sent=0), "eth0": nic(bytes_recv=0, bytes_sent=0)}),
            (
                102.0,
                {
                    "lo": nic(bytes_recv=9 * 2**30, bytes_sent=9 * 2**30),
                    "eth0": nic(bytes_recv=10 * 2**20, bytes_sent=5 * 2**20),
                },
            ),
            (104.0, {"lo0": nic(bytes_recv=0, bytes_sent=0), "eth0": nic(bytes_recv=0, bytes_sent=5 * 2**20)}),
        ]
    )
    now = {"t": 0.0}

    def counters(pernic: bool):
        now["t"], nics = next(readings)
        return nics

    monkeypatch.setattr(psutil, "net_io_counters", counters)
    monkeypatch.setattr(health.time, "monotonic", lambda: now["t"])
    io = health.DiskAndNetwork(str(tmp_path / "runs" / "r" / "health"))  # not made yet: its nearest folder's disk
    assert io.path == str(tmp_path)
    first = io.read()
    assert (first["network_receive_mb_s"], first["network_transmit_mb_s"]) == (5.0, 2.5)
    second = io.read()
    assert (second["network_receive_mb_s"], second["network_transmit_mb_s"]) == (0.0, 0.0)


def test_a_gpu_reads_what_nvml_gives_and_skips_what_it_cannot():
    class Nvml:
        NVML_TEMPERATURE_GPU = 0

        def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802 - NVML's names
            return SimpleNamespace(gpu=87)

        def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
            return SimpleNamespace(used=20 * 1024**3, total=80 * 1024**3)

        def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
            raise RuntimeError("not supported on this board")

        def nvmlDeviceGetTemperature(self, h, sensor):  # noqa: N802
            return 71

    assert health._one_gpu(Nvml(), object(), "gpu3_") == {
        "gpu3_utilization_percent": 87.0,
        "gpu3_memory_used_gb": 20.0,
        "gpu3_memory_percent": 25.0,
        "gpu3_temperature_c": 71.0,
    }


def test_one_sampler_per_node_and_none_without_system_metrics(tmp_path):
    store = SimpleNamespace(fs=pafs.LocalFileSystem(), root=str(tmp_path))
    on = BaseConfig(pipeline="digits")
    assert start_sampler(on, 1, store) is None  # the node's other ranks
    off = on.model_copy(update={"mlflow": on.mlflow.model_copy(update={"system_metrics": False})})
    assert start_sampler(off, 0, store) is None


def test_keys_name_the_node_not_the_rank():
    assert metric_key("gpu-node-7", "gpu0_power_w") == "system/gpu-node-7/gpu0_power_w"
    assert metric_key("a/b?c", "cpu_percent") == "system/a_b_c/cpu_percent"  # a key MLflow accepts


def _write(folder, node, *times):
    folder.mkdir(exist_ok=True)
    samples = [{"t": t, "n": i, "cpu_percent": 10.0 + i, "memory_percent": 50.0} for i, t in enumerate(times)]
    (folder / f"{node}.json").write_text(json.dumps({"node": node, "samples": samples[-KEEP:]}))


@pytest.fixture
def watched(tmp_path):
    clock = [0.0]
    logged, tags = [], {}
    watch = HealthWatch(
        pafs.LocalFileSystem(),
        str(tmp_path),
        interval_s=10.0,
        silent_after=3,
        log_metrics=lambda metrics, step: logged.append((step, metrics)),
        set_tags=tags.update,
        clock=lambda: clock[0],
    )
    return watch, clock, logged, tags


def test_each_sample_is_logged_once_and_a_silent_node_is_named_once(tmp_path, watched, caplog):
    watch, clock, logged, tags = watched
    _write(tmp_path, "old", 500.0)  # an earlier launch's node: logged, never named
    watch.poll()
    _write(tmp_path, "a", 1000.0)
    _write(tmp_path, "b", 1000.5)
    watch.poll()
    assert sorted(logged, key=lambda x: (x[0], sorted(x[1]))) == [
        (500, {"system/old/cpu_percent": 10.0, "system/old/memory_percent": 50.0}),
        (1000, {"system/a/cpu_percent": 10.0, "system/a/memory_percent": 50.0}),
        (1000, {"system/b/cpu_percent": 10.0, "system/b/memory_percent": 50.0}),
    ]
    logged.clear()
    watch.poll()
    assert logged == []  # nothing new
    with caplog.at_level(logging.WARNING, logger="raylane"):
        for second in range(10, 41, 10):  # a writes every interval; b has stopped
            clock[0] = second
            _write(tmp_path, "a", *(1000.0 + s for s in range(0, second + 1, 10)))
            watch.poll()
        watch.poll()
    assert [step for step, m in logged if "system/a/cpu_percent" in m] == [1010, 1020, 1030, 1040]
    assert not [m for _, m in logged if "system/b/cpu_percent" in m]
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 1 and named[0].startswith("node b has sent no health sample for 40 s (3 intervals of 10 s")
    assert tags == {SILENT_TAG + "b": named[0]} and set(watch.silent) == {"b"}
