"""B14: what one lost worker costs, today's path against replica groups (issue 62). Two workers
on an embedded Ray cluster, steps of ~1 s (a `slow` fault: the step time a real model would
have), one worker SIGKILLed at step KILL_AT:

- **whole group** (`fault_tolerance` off, `failure.max_failures: 1`, a checkpoint every
  CHECKPOINT_EVERY steps): Ray Train restarts every worker and they resume from the newest
  checkpoint, redoing the steps since;
- **replica groups** (2 groups of 1 worker): the other group steps on alone; the killed one
  restarts and heals from it.

Worker-seconds lost per fault: for each worker, the time from the kill to its first step past
the kill's step, less one step's time (what the worker would have spent on it anyway), summed
over the workers. The run's steps are written by a probe pipeline (scripts/benchmarks/fault_probe.py);
the sides run interleaved, and their spread over repeats is reported beside the medians."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from scripts.benchmarks.common import RAYLANE, REPO, stats

KILL_AT = 25
CHECKPOINT_EVERY = 10  # a kill lands on average half an interval after a save; here, 5 steps after
STEPS = 45
STEP_MS = 1000
SIDES = {
    "whole group restarts from its checkpoint": [
        "failure.max_failures=1",
        f"checkpoint.every_n_steps={CHECKPOINT_EVERY}",
    ],
    "replica groups (2 groups of 1 worker)": [
        "fault_tolerance.enabled=true",
        "fault_tolerance.replica_groups=2",
        "failure.max_failures=1",
        "checkpoint.every_n_steps=0",
    ],
}
RUN_TIMEOUT_S = 600


def b14(bench: Any) -> dict[str, Any]:
    repeats = min(max(bench.repeats, 2), 3)  # ~1.5 min a run: a spread, not an hour
    print(f"[bench] B14 worker-seconds lost per fault: {repeats} repeats of each side", flush=True)
    lost: dict[str, list[float]] = {side: [] for side in SIDES}
    details: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for i in range(repeats):
        for side in list(SIDES)[:: 1 if i % 2 == 0 else -1]:
            one = _one(bench, SIDES[side], f"b14-{i}-{len(details[side])}-{'ft' if 'replica' in side else 'whole'}")
            lost[side].append(one["lost_worker_s"])
            details[side].append(one)
            print(f"[bench]   {side}: {one['lost_worker_s']:.1f} worker-s lost", flush=True)
    whole, groups = (statistics.median(lost[side]) for side in SIDES)
    return {
        "kill_at_step": KILL_AT,
        "checkpoint_every": CHECKPOINT_EVERY,
        "step_ms": STEP_MS,
        "workers": 2,
        "lost_worker_s": {side: stats(v) for side, v in lost.items()},
        "whole_over_groups": whole / groups if groups else None,
        "runs": details,
    }


def _one(bench: Any, sets: list[str], name: str) -> dict[str, Any]:
    seen = bench.work / name / "seen"
    config = bench.work / f"{name}.yaml"
    config.write_text(f"pipeline: {REPO / 'scripts' / 'benchmarks' / 'fault_probe.py'}\n")
    argv = [
        *RAYLANE,
        "train",
        str(config),
        *(
            x
            for s in [
                *sets,
                f"run.name={name}",
                f"run.storage_path={bench.work / 'runs'}",
                "scaling.num_workers=2",
                "mlflow.enabled=false",
                "train.max_epochs=1",
                "train.batch_size=8",
                f"model.samples={STEPS * 2 * 8}",
                f"model.record={seen}",
                f"env.RAYLANE_FAULTS=slow@ms={STEP_MS}",
            ]
            for x in ("--set", s)
        ),
    ]
    log = bench.work / f"{name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            argv, cwd=bench.work, env=bench.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            victim = _wait_for_step(seen, KILL_AT, proc)
            killed = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            rc = proc.wait(RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {rc}; its output:\n{log.read_text()[-3000:]}")
    return {"lost_worker_s": _lost(seen, killed), "killed_unix": killed}


def _records(seen: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        path.stem: [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for path in sorted(seen.glob("*.jsonl"))
    }


def _wait_for_step(seen: Path, step: int, proc: subprocess.Popen) -> dict[str, Any]:
    """The last worker's record of `step` (group 1's, or rank 1's without groups), once written."""
    deadline = time.time() + RUN_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before step {step}")
        records = _records(seen) if seen.is_dir() else {}
        victim = records.get("g1-r0") or records.get("g--r1") or []
        if victim and victim[-1]["step"] >= step:
            return victim[-1]
        time.sleep(0.05)
    raise RuntimeError(f"no worker reached step {step} within {RUN_TIMEOUT_S} s")


def _lost(seen: Path, killed: float) -> float:
    """Each worker's time from the kill to its first step past the kill's step, less one step."""
    total = 0.0
    for worker, records in _records(seen).items():
        before = [r for r in records if r["time"] <= killed]
        step, steps = before[-1]["step"], [b["time"] - a["time"] for a, b in zip(before, before[1:], strict=False)]
        one = statistics.median(steps[-10:]) if steps else STEP_MS / 1000
        back = next((r for r in records if r["time"] > killed and r["step"] > step), None)
        if back is None:
            raise RuntimeError(f"{worker}: no step past {step} after the kill")
        total += max(back["time"] - killed - one, 0.0)
    return total


def rows(r: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    """The report's line: worker-seconds lost per fault, each side with its spread."""
    if not r or "lost_worker_s" not in r:
        return []
    sides = r["lost_worker_s"]
    shown = "; ".join(f"{side}: {s['median']:.1f} [{s['min']:.1f}–{s['max']:.1f}]" for side, s in sides.items())
    ratio = r.get("whole_over_groups")
    return [
        (
            "B14",
            f"worker-seconds lost per fault: one of 2 workers killed at step {r['kill_at_step']} "
            f"(steps of {r['step_ms']} ms, a checkpoint every {r['checkpoint_every']} steps)",
            shown + (f"; whole ÷ groups {ratio:.1f}x" if ratio else ""),
            "groups < whole",
            "yes" if ratio and ratio > 1 else "**no**",
        )
    ]
