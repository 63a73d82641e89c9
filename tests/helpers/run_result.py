"""A RunResult with every field set to a plain value (raylane.loop.protocols.result), for the tests of what
reads one: give the fields a test is about."""

from __future__ import annotations

from typing import Any

from raylane.loop.protocols.result import RunResult


def run_result(**changes: Any) -> RunResult:
    fields: dict[str, Any] = {
        "steps": 20,
        "epochs": 2,
        "partial_epoch": 0.0,
        "step_time_s": 0.01,
        "samples_per_s": 100.0,
        "train_s": 0.2,
        "train_wall_s": 0.2,
        "train_cpu_s": 0.2,
        "checkpoint_stall_s": 0.0,
        "epoch_end_s": [0.1, 0.2],
        "metrics": {},
        "memory": {"state_bytes_per_rank": 0, "peak_bytes": 0},
        "strategy": "ddp",
        "mesh": [2],
        "node_ranks": None,
        "world_size": 2,
        "backend": "gloo",
        "resumed_from_step": None,
        "checkpoint": None,
        "skipped_steps": 0,
        "skipped_rows": {},
        "failed_checkpoints": 0,
        "preempted": False,
        "node_leaving": False,
        "growing": False,
        "stop_reason": None,
        "early_stopped": False,
    }
    return RunResult(**{**fields, **changes})
