#!/usr/bin/env python3
"""Launch-to-first-step and last-step-to-exit for `raylane train` (embedded Ray, cold) and for
the same loop under plain torchrun, interleaved A/B, median of N.

    .venv/bin/python scripts/measure_startup.py --repeats 5

Launch is taken just before the process starts; first and last step come from the run's summary
(wall clock, same machine); exit is taken when the process has ended."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARGS = ["train", "regression", "--set", "train.max_epochs=1", "--set", "checkpoint.every_n_steps=0"]
LAUNCHERS = {
    "raylane (embedded Ray)": [sys.executable, "-m", "raylane"],
    "torchrun (same loop)": [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
    ],
}


def measure_once(argv: list[str], workdir: Path) -> dict[str, float]:
    summary = workdir / f"summary-{time.monotonic_ns()}.json"
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{workdir / 'mlflow.db'}")
    env.pop("RAY_ADDRESS", None)
    launched = time.time()
    proc = subprocess.run(
        [*argv, *ARGS, "--summary-json", str(summary)],
        cwd=workdir,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    exited = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}")
    timing = json.loads(summary.read_text())["timing"]
    return {
        "launch_to_first_step_s": timing["first_step_unix"] - launched,
        "last_step_to_exit_s": exited - timing["last_step_unix"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory() as tmp:
        measure_once(LAUNCHERS["torchrun (same loop)"], Path(tmp))  # warm the page cache once
        for _ in range(args.repeats):
            for name, argv in LAUNCHERS.items():  # interleaved, A B A B ...
                samples[name].append(measure_once(argv, Path(tmp)))
    print(f"| launcher | launch to first step (s) | last step to exit (s) |  (median [min-max] of {args.repeats})")
    print("|---|---|---|")
    for name, runs in samples.items():
        cells = []
        for key in ("launch_to_first_step_s", "last_step_to_exit_s"):
            values = [r[key] for r in runs]
            cells.append(f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
