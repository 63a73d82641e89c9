"""Benchmark B2b (see scripts.benchmarks.harness): launch → first step, phase by phase.

Four ways to start the same short run of `regression` on 2 ranks: raylane on a fresh embedded Ray
(cold), raylane joining a Ray head that is already up (warm: `raylane up`, or a `ray start --head`
of the bench's own where that command does not exist), raylane under torchrun, and Ray's floor:
the hand-written loop in a bare TorchTrainer (scripts/ddp_baseline.py --ray), cold and warm.
Each phase is seconds since the launching process started (raylane.loop.observe.startup.PHASES)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SIDES = (
    "raylane, Ray cold",
    "raylane, Ray warm",
    "raylane under torchrun",
    "bare TorchTrainer, cold",
    "bare TorchTrainer, warm",
)
HEAD_START_TIMEOUT_S = 120
# What `raylane up` and an embedded cluster set for Ray Train's controller (raylane.onray.cluster).
HEAD_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
}


def b2b(bench) -> dict[str, Any]:
    from scripts.benchmarks.common import QUIET, stats

    print("[bench] B2b launch to first step, phase by phase", flush=True)
    steps = 5
    sets = [*QUIET, f"train.max_steps={steps}", "scaling.num_workers=2"]
    # No `raylane up` head is found from here: the cold runs start their own cluster.
    cold = {"RAYLANE_HOME": str(bench.work / "no-head")}
    with _warm_head(bench) as (address, warm):
        join = ["--address", address] if address else []
        sides: dict[str, Callable[[], dict[str, float]]] = {
            SIDES[0]: lambda: _raylane(bench, sets, env=cold),
            SIDES[1]: lambda: _raylane(bench, sets, env=warm, args=join),
            SIDES[2]: lambda: _raylane(bench, sets, env=cold, launcher="torchrun"),
            SIDES[3]: lambda: _bare(bench, steps, env=cold),
            SIDES[4]: lambda: _bare(bench, steps, env=warm, args=["--address", address or _address(bench, warm)]),
        }
        sides[SIDES[1]]()  # the head's first run starts its first workers: later runs find it settled
        runs = bench.interleaved(sides)
    phases = {side: _phase_stats(rs, stats) for side, rs in runs.items()}
    return {
        "steps": steps,
        "workers": 2,
        "warm_head": "raylane up" if _has_up() else "ray start --head",
        "phases_s": phases,
    }


def _raylane(
    bench, sets: list[str], *, env: dict[str, str], args: list[str] = (), launcher: str = "ray"
) -> dict[str, float]:
    run = bench.raylane("regression", sets, launcher=launcher, env=env, args=list(args))
    return run["summary"]["timing"]["startup"]


def _bare(bench, steps: int, *, env: dict[str, str], args: list[str] = ()) -> dict[str, float]:
    run = bench.baseline("regression", steps, [], plain_ray=True, env=env, args=list(args))
    unix = {k: v for k, v in run["startup"].items() if v is not None}
    return {k: round(v - unix["launch"], 3) for k, v in unix.items()}


def _phase_stats(runs: list[dict[str, float]], stats) -> dict[str, Any]:
    from raylane.loop.observe.startup import PHASES

    seen = [p for p in PHASES if all(p in r for r in runs)]
    return {p: stats([r[p] for r in runs]) for p in seen}


def _has_up() -> bool:
    # raylane.clusters.local since issue 48; raylane.onray.localcluster in the checkouts before it
    for name in ("raylane.clusters.local", "raylane.onray.localcluster"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # its package is not there either
            continue
    return False


@contextmanager
def _warm_head(bench) -> Iterator[tuple[str | None, dict[str, str]]]:
    """(address to pass, environment) of a head that lives through the warm runs. With `raylane
    up`, runs join it without an address (its own RAYLANE_HOME, so a user's head is not touched)."""
    if _has_up():
        env = {"RAYLANE_HOME": str(bench.work / "head-home"), "RAY_AUTH_MODE": "token"}
        bench.run([*_raylane_cmd(), "up", "--num-cpus", "4"], env=env)
        try:
            yield None, env
        finally:
            bench.run([*_raylane_cmd(), "down"], env=env)
        return
    yield from _own_head(bench)


def _raylane_cmd() -> list[str]:
    from scripts.benchmarks.common import RAYLANE

    return RAYLANE


def _address(bench, env: dict[str, str]) -> str:
    """The address `raylane up` recorded (for the bare TorchTrainer, which knows nothing of it)."""
    return json.loads((Path(env["RAYLANE_HOME"]) / "cluster.json").read_text())["address"]


def _own_head(bench) -> Iterator[tuple[str, dict[str, str]]]:
    """`ray start --head --block` in a session of its own, token auth on, stopped by killing that
    session's processes (never `ray stop`: it stops every Ray on the machine)."""
    from scripts.benchmarks.common import PY

    token = bench.work / "auth_token"
    token.write_text(uuid.uuid4().hex)
    token.chmod(0o600)
    env = {**HEAD_ENV, "RAY_AUTH_TOKEN_PATH": str(token)}
    port, log = _free_port(), bench.work / "head.log"
    ray = str(Path(PY).parent / "ray")
    with open(log, "w") as f:
        head = subprocess.Popen(
            [
                ray,
                "start",
                "--head",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                "--num-cpus=4",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--temp-dir={bench.work / 'ray'}",
            ],
            env={**bench.env, **env},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}", env
    finally:
        _kill_session(head.pid)
        head.wait()


def _kill_session(sid: int) -> None:
    out = subprocess.run(["ps", "-eo", "pid=,sid="], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, session = map(int, line.split())
        if session == sid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
