"""CUDA memory snapshots on a profiled rank (profile.memory_snapshot_step, memory_snapshot_on_oom:
raylane.loop.observe.profiling.MemorySnapshots), in-process.

CUDA cannot run here (a CPU-only torch), so the two torch.cuda.memory functions a snapshot needs,
`_record_memory_history` and `_dump_snapshot`, are replaced by recorders (the dump writes a
file where torch's would): the only stand-in. Everything around them is real: the config, the
profiler on the rank, the run's folder, the Trainer's profiling context, the `oom` fault that
raises torch.OutOfMemoryError, and the listing and line the driver's summary gets."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import pytest
import torch

from raylane.config import ConfigError, load_config
from raylane.loop.checkpoint.storage import CheckpointStore
from raylane.loop.observe.faults import FaultPlan, parse
from raylane.loop.observe.observer import observing
from raylane.loop.observe.profiling import MemorySnapshots, StepProfiler
from raylane.tracking.observe import memory_snapshots, profile_line
from tests.conftest import REPO

DIGITS = REPO / "pipelines" / "digits.yaml"


@pytest.fixture
def cuda_memory(monkeypatch):
    """torch.cuda.memory's history and dump, recorded: [(name, argument)]."""
    calls: list[tuple[str, object]] = []

    def record(enabled="all", max_entries=None, **_):
        calls.append(("record", max_entries if enabled else None))

    def dump(path):
        calls.append(("dump", path))
        with open(path, "wb") as f:
            pickle.dump({"segments": [], "device_traces": []}, f)

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    return calls


def config(tmp_path, *overrides):
    return load_config(
        DIGITS,
        ["profile.enabled=true", f"run.storage_path={tmp_path}", "run.name=r", "profile.activities=[cpu]", *overrides],
    )


def test_the_keys_default_to_no_snapshot_and_bad_values_name_the_field():
    p = load_config(DIGITS).profile
    assert (p.memory_snapshot_step, p.memory_snapshot_on_oom, p.memory_history_entries) == (None, False, 100_000)
    assert load_config(DIGITS, ["profile.memory_snapshot_step=40"]).profile.memory_snapshot_step == 40
    for override, field, value in [
        ("profile.memory_snapshot_step=0", "profile.memory_snapshot_step", "0"),
        ("profile.memory_history_entries=10", "profile.memory_history_entries", "10"),
        ("profile.memory_snapshot_on_oom=maybe", "profile.memory_snapshot_on_oom", "maybe"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(DIGITS, [override])
        assert field in str(info.value) and value in str(info.value)


def test_without_a_gpu_one_warning_and_nothing_else(tmp_path, cuda_memory, caplog):
    cfg = config(tmp_path, "profile.memory_snapshot_step=2", "profile.memory_snapshot_on_oom=true")
    snaps = MemorySnapshots(cfg.profile, CheckpointStore(f"{tmp_path}/r", None, 0), 0, "n", on_gpu=False)
    with caplog.at_level(logging.WARNING, logger="raylane"):
        snaps.start()
        for step in (1, 2, 3):
            snaps.after_step(step)
        snaps.out_of_memory()
        snaps.stop()
    [warning] = [r.getMessage() for r in caplog.records]
    assert "rank 0 has no GPU" in warning and "profile.memory_snapshot_step" in warning
    assert cuda_memory == [] and snaps.written == [] and not os.path.exists(f"{tmp_path}/r/profiles")


def test_no_snapshot_asked_records_no_history(tmp_path, cuda_memory, caplog):
    snaps = MemorySnapshots(config(tmp_path).profile, CheckpointStore(f"{tmp_path}/r", None, 0), 0, "n", on_gpu=True)
    with caplog.at_level(logging.WARNING, logger="raylane"):
        snaps.start()
        snaps.after_step(1)
        snaps.out_of_memory()
        snaps.stop()
    assert cuda_memory == [] and not caplog.records


def test_a_snapshot_after_the_chosen_step_then_the_history_stops(tmp_path, cuda_memory):
    cfg = config(tmp_path, "profile.memory_snapshot_step=3", "profile.memory_history_entries=5000")
    snaps = MemorySnapshots(cfg.profile, CheckpointStore(f"{tmp_path}/r", None, 1), 1, "gpu node/7", on_gpu=True)
    snaps.start()
    for step in (1, 2, 3, 4, 5):
        snaps.after_step(step)
    snaps.out_of_memory()  # not asked for: nothing
    snaps.stop()
    target = f"{tmp_path}/r/profiles/memory-rank1-gpu_node_7-step3.pickle"
    assert snaps.written == [target] and pickle.loads(Path(target).read_bytes())["segments"] == []
    assert [c[0] for c in cuda_memory] == ["record", "dump", "record"]
    assert cuda_memory[0] == ("record", 5000) and cuda_memory[2] == ("record", None)  # recorded, dumped, stopped
    assert memory_snapshots(cfg) == [target]


def test_the_oom_fault_leaves_a_snapshot_and_the_error_goes_on(tmp_path, cuda_memory):
    """The Trainer's observers' context (the profiler among them) around a loop that the real `oom`
    fault ends: the rank's snapshot is written, the OutOfMemoryError is the one raised, the
    history is stopped."""
    cfg = config(tmp_path, "profile.memory_snapshot_on_oom=true", "profile.memory_snapshot_step=1")
    store = CheckpointStore(f"{tmp_path}/r", None, 0)
    profiler = StepProfiler(cfg.profile, store, 0, torch.device("cuda"))  # the rank a GPU would be
    profiler.node = profiler.memory.node = "n0"
    plan = FaultPlan(parse("oom@rank=0,batch=4"), rank=0)
    with pytest.raises(torch.OutOfMemoryError, match="injected: rank 0 out of memory"):
        with observing([profiler], 0):
            for step in (1, 2):
                plan.before_forward(2)
                profiler.step(step)
            plan.before_forward(4)
    folder = f"{tmp_path}/r/profiles"
    assert sorted(os.listdir(folder)) == ["memory-rank0-n0-oom.pickle", "memory-rank0-n0-step1.pickle"]
    assert cuda_memory[-1] == ("record", None) and not profiler.memory.recording
    snaps = memory_snapshots(cfg)
    line = profile_line([], snaps)
    assert line.startswith("none written") and f"memory snapshots in {folder}: memory-rank0-n0-oom.pickle, " in line
    assert "https://pytorch.org/memory_viz" in line
    both = profile_line([f"{folder}/trace-rank0-n0.json.gz"], snaps)
    assert both.startswith(f"1 trace in {folder} (") and "; memory snapshots: memory-rank0-n0-oom.pickle, " in both


def test_another_error_leaves_no_oom_snapshot(tmp_path, cuda_memory):
    cfg = config(tmp_path, "profile.memory_snapshot_on_oom=true")
    profiler = StepProfiler(cfg.profile, CheckpointStore(f"{tmp_path}/r", None, 0), 0, torch.device("cuda"))
    with pytest.raises(ValueError), observing([profiler], 0):
        raise ValueError("not memory")
    assert [c[0] for c in cuda_memory] == ["record", "record"] and not os.path.exists(f"{tmp_path}/r/profiles")
