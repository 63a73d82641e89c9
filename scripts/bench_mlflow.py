#!/usr/bin/env python3
"""MLflow's cost on training speed: the same `digits` run with tracking off, to a local sqlite
file, and to a real `mlflow server` over HTTP; A/B/C interleaved, median of N.

    .venv/bin/python scripts/bench_mlflow.py --repeats 5

The cost is per step, in steady state: the slope of training time between a short and a long
run (SHORT and LONG epochs), so one-time costs (importing mlflow on rank 0's logger thread,
opening the run, the end-of-run records) are excluded, as they are from a long run's step
time. Training time is from the summary (first to last step). 2 gloo ranks under torchrun, one
thread each. Metrics every 10 steps (the default), system metrics every 10 s.

End to end, two cores shared by two ranks are noisy (±10-20% between repeats), too noisy to
resolve 1%. So the cost is also attributed directly: rank 0's summary reports the time spent
inside `log()` on the training thread and the CPU time of the sender and system-metrics threads
(`tracking_cost_s`); their per-step slope over the untracked step time bounds the slowdown, since
on busy cores every CPU-second those threads use is at worst a second taken from training."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "raylane"]
ARGS = ["train", "digits", "--set", "checkpoint.every_n_steps=0", "--set", "mlflow.log_model=false"]
SHORT, LONG = 10, 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(data: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(
        os.environ, MLFLOW_PORT=str(port), MLFLOW_DATA=str(data), MLFLOW_BIN=str(Path(sys.executable).parent / "mlflow")
    )
    proc = subprocess.Popen(
        [str(REPO / "scripts/mlflow-server.sh")],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).close()
            return proc, url
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("mlflow server did not start")


def train_seconds(work: Path, mode: str, server_url: str, epochs: int) -> tuple[float, int, float]:
    """(seconds from the first to the last step, steps, seconds of logging cost on rank 0)."""
    summary = work / f"{mode}-{time.monotonic_ns()}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    extra = []
    if mode == "off":
        extra = ["--set", "mlflow.enabled=false"]
    elif mode == "sqlite":
        env["MLFLOW_TRACKING_URI"] = f"sqlite:///{work / 'mlflow.db'}"
    else:
        env["MLFLOW_TRACKING_URI"] = server_url
    argv = [*TORCHRUN, *ARGS, "--set", f"train.max_epochs={epochs}", *extra, "--summary-json", str(summary)]
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    s = json.loads(summary.read_text())
    cost = sum((s.get("tracking_cost_s") or {}).values())
    return s["timing"]["last_step_unix"] - s["timing"]["first_step_unix"], s["steps"], cost


def step_ms(work: Path, mode: str, server_url: str) -> tuple[float, float]:
    """Steady-state (milliseconds per step, logging milliseconds per step): slopes between a
    short and a long run."""
    t_short, n_short, c_short = train_seconds(work, mode, server_url, SHORT)
    t_long, n_long, c_long = train_seconds(work, mode, server_url, LONG)
    return 1000 * (t_long - t_short) / (n_long - n_short), 1000 * (c_long - c_short) / (n_long - n_short)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    modes = ("off", "sqlite", "http")
    samples: dict[str, list[float]] = {m: [] for m in modes}
    logging_ms: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        server, url = start_server(work / "server")
        try:
            train_seconds(work, "off", url, SHORT)  # warm-up: page cache, bytecode
            for _ in range(args.repeats):
                for mode in modes:  # interleaved
                    step, cost = step_ms(work, mode, url)
                    samples[mode].append(step)
                    logging_ms[mode].append(cost)
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    base = statistics.median(samples["off"])
    result = {}
    print(
        f"| tracking | ms per step (median [min-max] of {args.repeats}) | end to end vs off "
        "| logging ms per step (rank 0) | attributed cost |\n|---|---|---|---|---|"
    )
    for mode in modes:
        med = statistics.median(samples[mode])
        log_med = statistics.median(logging_ms[mode])
        result[mode] = {
            "step_ms": samples[mode],
            "median_ms": med,
            "cost_pct": 100 * (med / base - 1),
            "logging_ms_per_step": logging_ms[mode],
            "attributed_cost_pct": 100 * log_med / base,
        }
        print(
            f"| {mode} | {med:.3f} [{min(samples[mode]):.3f}-{max(samples[mode]):.3f}] | "
            f"{result[mode]['cost_pct']:+.2f}% | {log_med:.4f} | {result[mode]['attributed_cost_pct']:.2f}% |"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
