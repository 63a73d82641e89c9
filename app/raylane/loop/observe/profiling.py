"""`profile:` on a rank: torch.profiler over a window of steps (raylane.config.observe.ProfileSection),
an observer of the Trainer's loop (`StepProfiler`; made mid-run on a rank the step times name the
slowest, raylane.loop.observe.observer.Deferred). Each window's trace goes into the run's folder as a gzipped
Chrome trace, `profiles/trace-rank<R>-<node>.json.gz` (`<node>`: the node's name in the run's
records, raylane.loop.distributed.groups.node_name), beside its table of the top operations by
self time (`top-ops-rank<R>-<node>.txt`, `.md`, `.csv`), and on a GPU the rank's CUDA memory
snapshots (`MemorySnapshots`: `memory-rank<R>-<node>-step<S>.pickle`, `-oom.pickle`); the driver
logs the folder to MLflow. Imported only when this rank is profiled: with `profile` off, nothing
here runs. Ray-free."""

from __future__ import annotations

import csv
import gzip
import importlib
import io
import logging
import os
import re
import shutil
import tempfile
from typing import Any

import torch
import torch.profiler as tp

from raylane.config.observe import ProfileSection
from raylane.loop.checkpoint.storage import CheckpointStore
from raylane.loop.distributed.groups import node_name
from raylane.loop.observe.observer import Observer

log = logging.getLogger("raylane")
FOLDER = "profiles"


def trace_stem(rank: int, node: str, cycle: int, repeat: int) -> str:
    """`rank<R>-<node>`, and the window's number when there are several."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node)
    return f"rank{rank}-{safe}" + (f"-w{cycle}" if repeat != 1 else "")


class StepProfiler(Observer):
    """torch.profiler on this rank: `start` before the first step, `step` after each, `close`
    after the last (a window the run cut short is written as far as it got); as the loop's
    observer, from `on_train_start` to `on_train_end`, where a loop ending out of memory leaves
    its memory snapshot first (profile.memory_snapshot_on_oom), then fails as it would without a
    profile. Made before the loop starts: its set-up's imports are not in the steps timed."""

    def __init__(self, cfg: ProfileSection, store: CheckpointStore, rank: int, device: torch.device) -> None:
        self.cfg, self.store, self.rank = cfg, store, rank
        self.node = node_name()
        self.written: list[str] = []
        activities = [tp.ProfilerActivity.CPU] if "cpu" in cfg.activities else []
        if "cuda" in cfg.activities and device.type == "cuda":
            activities.append(tp.ProfilerActivity.CUDA)
        window = tp.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat)
        self._first = 1  # torch's step count of the run's first profiled step (`start`)
        self.prof = tp.profile(
            activities=activities or [tp.ProfilerActivity.CPU],
            schedule=lambda n: window(max(n - self._first, 0)),
            on_trace_ready=self._ready,
            record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack,
        )
        self._on_gpu = device.type == "cuda"
        self.memory = MemorySnapshots(cfg, store, rank, self.node, on_gpu=self._on_gpu)
        # The tracer's start asks torch for its compiler's config, which imports the compiler
        # (seconds, once): paid here, before training, not inside the steps being timed.
        if hasattr(torch, "_inductor"):
            importlib.import_module("torch._inductor.config")

    def start(self, step: int = 0) -> None:
        """Before the run's step `step + 1` (the run's count, as the logs give it): the trace's
        `ProfilerStep#N` spans are the run's steps, on a rank profiled from a resume or named the
        slowest mid-run as on rank 0 from the start; the window counts from here."""
        self._first = self.prof.step_num = step + 1
        self.memory.start()
        self.prof.start()

    def step(self, step: int) -> None:
        """After the run's step `step` (its count, as the logs give it)."""
        self.prof.step()
        self.memory.after_step(step)

    def out_of_memory(self) -> None:
        """The loop is ending on torch.OutOfMemoryError (raised on, after this returns)."""
        self.memory.out_of_memory()

    def close(self) -> None:
        try:
            self.prof.stop()
        except Exception as exc:  # noqa: BLE001 - a profile is best effort; training's outcome stands
            log.warning("profile: rank %d's trace was not written: %s", self.rank, exc)
        self.memory.stop()

    def on_train_start(self, step: int) -> None:
        self.start(step)

    def on_step_end(self, step: int) -> None:
        self.step(step)

    def on_train_end(self, error: BaseException | None) -> None:
        """Its trace written however the loop ends, before the last window's figures are
        gathered (so before rank 0 goes on)."""
        if error is not None and is_out_of_memory(error):
            self.out_of_memory()
        self.close()

    def _ready(self, prof: Any) -> None:
        try:
            self._write(prof)
        except Exception as exc:  # noqa: BLE001 - a profile is best effort: training goes on without it
            log.warning("profile: rank %d's trace was not written: %s: %s", self.rank, type(exc).__name__, exc)

    def _write(self, prof: Any) -> None:
        stem = trace_stem(self.rank, self.node, len(self.written), self.cfg.repeat)
        folder = f"{self.store.root}/{FOLDER}"
        with tempfile.TemporaryDirectory(prefix="raylane-profile-") as tmp:
            raw = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(raw)
            gz = os.path.join(tmp, f"trace-{stem}.json.gz")
            with open(raw, "rb") as src, gzip.open(gz, "wb", compresslevel=5) as dst:
                shutil.copyfileobj(src, dst)
            tables = top_ops_tables(prof.key_averages(), self.cfg.top_ops, self._on_gpu)
            for ext, text in tables.items():
                with open(os.path.join(tmp, f"top-ops-{stem}.{ext}"), "w") as f:
                    f.write(text)
            self.store.fs.create_dir(folder, recursive=True)
            for name in sorted(os.listdir(tmp)):
                if name != "trace.json":
                    self._put(os.path.join(tmp, name), f"{folder}/{name}")
        self.written.append(f"{folder}/trace-{stem}.json.gz")
        log.debug("profile: rank %d wrote %s", self.rank, self.written[-1])  # the run ends saying where

    def _put(self, local: str, target: str) -> None:
        put(self.store, local, target)


def put(store: CheckpointStore, local: str, target: str) -> None:
    """A local file into the run's storage (a shared folder or `s3://`)."""
    # compression=None: pyarrow would gzip a `.gz` name a second time.
    with open(local, "rb") as src, store.fs.open_output_stream(target, compression=None) as dst:
        shutil.copyfileobj(src, dst)


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or an error raised from or while handling one."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, torch.OutOfMemoryError):
            return True
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return False


class MemorySnapshots:
    """CUDA memory snapshots on a profiled rank (profile.memory_snapshot_step, memory_snapshot_on_oom):
    the allocator's history is recorded from `start` (only when a snapshot is asked for: recording
    takes a stack at every allocation), dumped after the chosen step and, on request, when the loop
    ends on an out-of-memory error; the history stops after the last dump it can still owe.

    `torch.cuda.memory._record_memory_history` and `_dump_snapshot` are torch's documented API for
    this (pytorch.org/docs/stable/torch_cuda_memory.html), underscored though they are: they are
    called here and nowhere else in raylane, so a rename in torch is one place to follow."""

    def __init__(self, cfg: ProfileSection, store: CheckpointStore, rank: int, node: str, *, on_gpu: bool) -> None:
        self.at_step, self.on_oom = cfg.memory_snapshot_step, cfg.memory_snapshot_on_oom
        self.entries = cfg.memory_history_entries
        self.store, self.rank, self.node, self.on_gpu = store, rank, node, on_gpu
        self.wanted = self.at_step is not None or self.on_oom
        self.recording = False
        self.written: list[str] = []

    def start(self) -> None:
        if not self.wanted:
            return
        if not self.on_gpu:  # the same config runs on a laptop: said once, not an error
            log.warning(
                "profile: rank %d has no GPU: CUDA memory snapshots (profile.memory_snapshot_step, "
                "memory_snapshot_on_oom) need one; none is taken",
                self.rank,
            )
            return
        try:
            torch.cuda.memory._record_memory_history(max_entries=self.entries)
        except Exception as exc:  # noqa: BLE001 - a snapshot is best effort: training goes on without it
            log.warning("profile: rank %d cannot record its memory history: %s: %s", self.rank, type(exc).__name__, exc)
            return
        self.recording = True

    def after_step(self, step: int) -> None:
        if self.recording and self.at_step is not None and step >= self.at_step:
            if step == self.at_step:  # a launch resumed past it takes none
                self._dump(f"step{step}")
            if not self.on_oom:  # nothing more is owed: stop paying for the stacks
                self.stop()

    def out_of_memory(self) -> None:
        if self.recording and self.on_oom:
            self._dump("oom")

    def stop(self) -> None:
        if self.recording:
            self.recording = False
            torch.cuda.memory._record_memory_history(enabled=None)

    def _dump(self, tag: str) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", self.node)
        target = f"{self.store.root}/{FOLDER}/memory-rank{self.rank}-{safe}-{tag}.pickle"
        try:
            with tempfile.TemporaryDirectory(prefix="raylane-memory-") as tmp:
                local = os.path.join(tmp, "snapshot.pickle")
                torch.cuda.memory._dump_snapshot(local)
                self.store.fs.create_dir(f"{self.store.root}/{FOLDER}", recursive=True)
                put(self.store, local, target)
        except Exception as exc:  # noqa: BLE001 - a snapshot is best effort: the run's outcome stands
            log.warning(
                "profile: rank %d's memory snapshot was not written: %s: %s", self.rank, type(exc).__name__, exc
            )
            return
        self.written.append(target)


def top_ops_tables(averages: Any, rows: int, on_gpu: bool) -> dict[str, str]:
    """The top `rows` operations by self time (the device's, on a GPU), as text (torch's own
    table), markdown and csv."""
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = sorted(averages, key=lambda e: getattr(e, key, 0.0), reverse=True)[:rows]
    total = sum(getattr(e, key, 0.0) for e in averages) or 1.0
    header = ["operation", "calls", "self_ms", "self_share", "total_ms"]
    table = [
        [
            e.key,
            e.count,
            f"{getattr(e, key, 0.0) / 1000:.3f}",
            f"{getattr(e, key, 0.0) / total:.1%}",
            f"{(e.device_time_total if on_gpu else e.cpu_time_total) / 1000:.3f}",
        ]
        for e in events
    ]
    out = io.StringIO()
    csv.writer(out).writerows([header, *table])
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    md += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in table]
    return {
        "txt": averages.table(sort_by=key, row_limit=rows),
        "md": "\n".join(md) + "\n",
        "csv": out.getvalue(),
    }
