"""`profile:` on a rank: torch.profiler over a window of steps (raylane.config.observe.ProfileSection),
driven by the Trainer's step end. Each window's trace goes into the run's folder as a gzipped
Chrome trace, `profiles/trace-rank<R>-<node>.json.gz`, beside its table of the top operations by
self time (`top-ops-rank<R>-<node>.txt`, `.md`, `.csv`); the driver logs the folder to MLflow.
Imported only when this rank is profiled: with `profile` off, nothing here runs. Ray-free."""

from __future__ import annotations

import csv
import gzip
import importlib
import io
import logging
import os
import re
import shutil
import socket
import tempfile
from typing import Any

import torch
import torch.profiler as tp

from raylane.config.observe import ProfileSection
from raylane.loop.checkpoint.storage import CheckpointStore

log = logging.getLogger("raylane")
FOLDER = "profiles"


def trace_stem(rank: int, node: str, cycle: int, repeat: int) -> str:
    """`rank<R>-<node>`, and the window's number when there are several."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node)
    return f"rank{rank}-{safe}" + (f"-w{cycle}" if repeat != 1 else "")


class StepProfiler:
    """torch.profiler on this rank: `start` before the first step, `step` after each, `close`
    after the last (a window the run cut short is written as far as it got)."""

    def __init__(self, cfg: ProfileSection, store: CheckpointStore, rank: int, device: torch.device) -> None:
        self.cfg, self.store, self.rank = cfg, store, rank
        self.node = socket.gethostname()
        self.written: list[str] = []
        activities = [tp.ProfilerActivity.CPU] if "cpu" in cfg.activities else []
        if "cuda" in cfg.activities and device.type == "cuda":
            activities.append(tp.ProfilerActivity.CUDA)
        self.prof = tp.profile(
            activities=activities or [tp.ProfilerActivity.CPU],
            schedule=tp.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat),
            on_trace_ready=self._ready,
            record_shapes=cfg.record_shapes,
            profile_memory=cfg.profile_memory,
            with_stack=cfg.with_stack,
        )
        self._on_gpu = device.type == "cuda"
        # The tracer's start asks torch for its compiler's config, which imports the compiler
        # (seconds, once): paid here, before training, not inside the steps being timed.
        if hasattr(torch, "_inductor"):
            importlib.import_module("torch._inductor.config")

    def start(self) -> None:
        self.prof.start()

    def step(self) -> None:
        self.prof.step()

    def close(self) -> None:
        try:
            self.prof.stop()
        except Exception as exc:  # noqa: BLE001 - a profile is best effort; training's outcome stands
            log.warning("profile: rank %d's trace was not written: %s", self.rank, exc)

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
        # compression=None: pyarrow would gzip a `.gz` name a second time.
        with open(local, "rb") as src, self.store.fs.open_output_stream(target, compression=None) as dst:
            shutil.copyfileobj(src, dst)


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
