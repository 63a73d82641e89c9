#!/usr/bin/env python3
"""Inject each fault raylane promises to survive into a real run and measure what it cost:
steps lost, time to recover or to detect, and whether the end result is bit-exact.

    .venv/bin/python scripts/reliability_drill.py [--out docs/reliability-figures.json]

Runs `digits` on 2 gloo workers under an embedded Ray (and torchrun where noted), one scenario
after another, in a temporary directory. Prints a markdown table; about 5 minutes on 2 cores."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from raylane.config import load_config  # noqa: E402
from raylane.loop import checkpoint  # noqa: E402
from raylane.loop.run import build_optimizer  # noqa: E402
from raylane.pipelines.digits import build_model  # noqa: E402

RAYLANE = [sys.executable, "-m", "raylane", "train", "digits"]
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node",
    "2",
    "-m",
    "raylane",
    "train",
    "digits",
]
EVERY = 20
COMMON = ["--set", "train.max_epochs=30", "--set", f"checkpoint.every_n_steps={EVERY}"]
STARTED: list = []  # every run, stopped by id at the end whatever happens


class Run:
    def __init__(self, work: Path, argv: list[str], name: str, *extra: str, faults: str = "") -> None:
        self.work, self.name = work, name
        self.summary_path = work / f"{name}-{time.monotonic_ns()}.json"
        env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{work / 'mlflow.db'}", RAYLANE_FAULTS=faults)
        env.pop("RAY_ADDRESS", None)
        self.log = open(work / f"{name}.log", "a")
        self.proc = subprocess.Popen(
            [*argv, "--set", f"run.name={name}", *COMMON, *extra, "--summary-json", str(self.summary_path)],
            cwd=work,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        STARTED.append(self)

    def manifest(self, step: int) -> Path:
        return self.work / "runs" / self.name / checkpoint.checkpoint_name(step) / checkpoint.MANIFEST_FILE

    def wait_for_checkpoint(self, step: int) -> float:
        while not self.manifest(step).exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} ended before checkpoint {step}")
            time.sleep(0.05)
        return time.time()

    def workers(self) -> list[int]:
        """Ray Train worker processes (in this run's session), or torchrun's ranks (children of
        torchrun, each in a session of its own)."""
        out = subprocess.run(["ps", "-eo", "pid=,ppid=,sid=,args="], capture_output=True, text=True).stdout
        rows = [line.split(None, 3) for line in out.splitlines()]
        return [
            int(r[0])
            for r in rows
            if len(r) == 4
            and (
                (int(r[2]) == self.proc.pid and r[3].startswith("ray::RayTrainWorker"))
                or (int(r[1]) == self.proc.pid and " -m raylane train" in r[3])
            )
        ]

    def stop(self) -> None:
        """Kill by id whatever is left of this run (after a failed scenario)."""
        out = subprocess.run(["ps", "-eo", "pid=,ppid=,sid="], capture_output=True, text=True).stdout
        rows = [tuple(map(int, line.split())) for line in out.splitlines()]
        for pid in [self.proc.pid] + [p for p, pp, sid in rows if sid == self.proc.pid or pp == self.proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def finish(self, timeout_s: float = 600) -> dict:
        try:
            self.proc.wait(timeout_s)
        finally:
            self.stop()
            self.log.close()
        return json.loads(self.summary_path.read_text())


def _weights(path: str) -> dict[str, torch.Tensor]:
    cfg = load_config("digits")
    model = build_model(cfg.model)
    checkpoint.load(path, model, build_optimizer(model, cfg))
    return model.state_dict()


def _same(a: dict, b: dict) -> bool:
    wa, wb = _weights(a["checkpoint"]), _weights(b["checkpoint"])
    return all(torch.equal(wa[k], wb[k]) for k in wb)


def kill_worker(work: Path, calm: dict) -> dict:
    run = Run(work, RAYLANE, "kill9", "--set", "failure.max_failures=1")
    run.wait_for_checkpoint(2 * EVERY)
    killed_at = time.time()
    os.kill(run.workers()[-1], signal.SIGKILL)
    s = run.finish()
    first_after = s["timing"]["restart_first_step_unix"][0]
    return {
        "fault": "worker process killed (kill -9), failure.max_failures=1",
        "survived": s["status"] == "FINISHED",
        "restarts": s["restarts"],
        "resumed_from_step": s["resumed_from_step"],
        "steps_lost": f"<= {EVERY} (the checkpoint interval)",
        "recover_s": round(first_after - killed_at, 1),
        "bit_exact": _same(s, calm),
    }


def preempt(work: Path, calm: dict, argv: list[str], who: str) -> dict:
    name = "preempt-" + ("torchrun" if argv is TORCHRUN else who)
    run = Run(work, argv, name)
    run.wait_for_checkpoint(2 * EVERY)
    signalled_at = time.time()
    target = run.proc.pid if who == "driver" else run.workers()[-1]
    os.kill(target, signal.SIGTERM)
    stopped = run.finish()
    stop_s = time.time() - signalled_at
    again = Run(work, argv, name).finish()
    return {
        "fault": f"SIGTERM to the {who}" + (" (torchrun)" if argv is TORCHRUN else ""),
        "survived": stopped["status"] == "KILLED" and again["status"] == "FINISHED",
        "restarts": 0,
        "resumed_from_step": again["resumed_from_step"],
        "steps_lost": stopped["steps"] - again["resumed_from_step"],
        "recover_s": f"stopped {stop_s:.1f} s after the signal; relaunch to first step "
        f"{again['timing']['launch_to_first_step_s']:.1f} s",
        "bit_exact": _same(again, calm),
    }


def failing(work: Path, faults: str, label: str, *extra: str) -> dict:
    s = Run(work, RAYLANE, faults.split("@")[0], *extra, faults=faults).finish()
    detected = s["timing"]["launched_unix"] + s["wall_s"] - s["timing"]["first_step_unix"]
    return {
        "fault": label,
        "survived": "fails cleanly: " + s["error"][:110],
        "restarts": s["restarts"],
        "resumed_from_step": None,
        "steps_lost": "-",
        "recover_s": f"run ended {detected:.1f} s after its first step",
        "bit_exact": "-",
    }


def corrupt_latest(work: Path, calm: dict) -> dict:
    first = Run(work, RAYLANE, "corrupt", "--set", "train.max_steps=60").finish()
    ckpt = Path(first["checkpoint"])
    shard = next(p for p in (ckpt / "state.pt", *ckpt.glob("__*_*.distcp")) if p.exists())
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    again = Run(work, RAYLANE, "corrupt").finish()
    return {
        "fault": "latest checkpoint truncated",
        "survived": again["status"] == "FINISHED",
        "restarts": 0,
        "resumed_from_step": again["resumed_from_step"],
        "steps_lost": 60 - again["resumed_from_step"],
        "recover_s": "-",
        "bit_exact": _same(again, calm),
    }


def disk_full(work: Path) -> dict:
    s = Run(
        work, TORCHRUN, "diskfull", "--set", "checkpoint.on_error=warn", faults=f"diskfull@rank=1,step={2 * EVERY}"
    ).finish()
    return {
        "fault": "disk full while saving (ENOSPC), on_error=warn, torchrun",
        "survived": s["status"] == "FINISHED",
        "restarts": 0,
        "resumed_from_step": None,
        "steps_lost": 0,
        "recover_s": f"{s['failed_checkpoints']} checkpoint skipped, previous one kept",
        "bit_exact": "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        stack.callback(lambda: [run.stop() for run in STARTED])
        work = Path(tmp)
        calm = Run(work, RAYLANE, "calm").finish()
        rows.append(kill_worker(work, calm))
        rows.append(preempt(work, calm, RAYLANE, "driver"))
        rows.append(preempt(work, calm, RAYLANE, "worker"))
        rows.append(preempt(work, calm, TORCHRUN, "rank"))
        rows.append(corrupt_latest(work, calm))
        rows.append(failing(work, "raise@rank=1,step=50", "a rank raises"))
        rows.append(
            failing(work, "hang@rank=0,step=50", "a rank hangs (dist.timeout_s=10)", "--set", "dist.timeout_s=10")
        )
        rows.append(disk_full(work))
    columns = ["fault", "survived", "restarts", "resumed_from_step", "steps_lost", "recover_s", "bit_exact"]
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
