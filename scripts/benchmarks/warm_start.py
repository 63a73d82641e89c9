"""Benchmark B2w (see scripts.benchmarks.harness): the first step on a `raylane up` head that keeps
warm workers (issue 52), against a head without them (`--warm 0`, the head before issue 52) and
torchrun; and a 5-epoch run end to end on each.

Each arm is timed as a stopwatch sees the command: from starting the process (interpreter and
imports included) to rank 0's first step (the summary's `timing.first_step_unix`), and to its exit.
The arms interleave (A B C D A B C D ...) so that the machine's noise falls on all alike; each
figure carries the 1-minute load average at its start. `warm, pool idle` waits until the head's
pool is whole and quiet (the last run's refill done); `warm, back-to-back` starts the moment the
run before it ended, while that run's refill still imports torch."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

ARMS = ("head without warm workers", "raylane under torchrun", "warm head, pool idle", "warm head, back-to-back")
POOL_WAIT_S = 300
QUIET_FOR_S = 2.0  # the pool is ready once it used under QUIET_CPU_S of CPU for this long
QUIET_CPU_S = 0.1  # idle workers' threads use a little; an importing worker a whole core
EPOCHS = 5


def b2w(bench) -> dict[str, Any]:
    from scripts.benchmarks.common import QUIET

    print("[bench] B2w first step on a head with warm workers", flush=True)
    first = [*QUIET, "train.max_steps=5", "scaling.num_workers=2"]
    whole = [*QUIET, f"train.max_epochs={EPOCHS}", "scaling.num_workers=2"]
    with _head(bench, "cold-home", ["--warm", "0"]) as cold, _head(bench, "warm-home", ["--warm"]) as warm:
        pool = _warm_of(warm)  # read while the head's record is there
        bench.raylane("regression", first, env=warm)  # the head's first run: later ones find it settled
        results = {}
        for name, sets in (("first_step", first), ("five_epochs", whole)):
            sides: dict[str, Callable[[], dict[str, Any]]] = {
                ARMS[0]: partial(_timed, bench, sets, cold),
                ARMS[1]: partial(_timed, bench, sets, cold, launcher="torchrun"),
                ARMS[2]: partial(_timed, bench, sets, warm, pool=True),
                ARMS[3]: partial(_timed, bench, sets, warm),
            }
            results[name] = _summarised(bench.interleaved(sides))
    return {"steps": 5, "epochs": EPOCHS, "workers": 2, "pool": pool, **results}


def _timed(bench, sets: list[str], env: dict[str, str], launcher: str = "ray", pool: bool = False) -> dict[str, Any]:
    waited = _pool_ready(env) if pool else None
    load = os.getloadavg()[0]
    run = bench.raylane("regression", sets, launcher=launcher, env=env)
    warm = run["summary"]["timing"].get("warm_actors") or {}
    return {
        "first_step_s": run["first_step"] - run["launched"],
        "exit_s": run["exited"] - run["launched"],
        "load_1m": load,
        "warm_actors": sum(warm.values()),
        "actors": len(warm),
        "pool_wait_s": waited,
    }


def _summarised(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    from scripts.benchmarks.common import stats

    return {
        arm: {
            "first_step_s": stats([r["first_step_s"] for r in rs]),
            "exit_s": stats([r["exit_s"] for r in rs]),
            "load_1m": [round(r["load_1m"], 2) for r in rs],
            "warm_actors": [f"{r['warm_actors']}/{r['actors']}" for r in rs],
            "pool_wait_s": [r["pool_wait_s"] for r in rs],
        }
        for arm, rs in runs.items()
    }


@contextmanager
def _head(bench, home: str, args: list[str]) -> Iterator[dict[str, str]]:
    from scripts.benchmarks.common import RAYLANE

    env = {"RAYLANE_HOME": str(bench.work / home), "RAY_AUTH_MODE": "token"}
    bench.run([*RAYLANE, "up", "--num-cpus", "4", *args], env=env)
    try:
        yield env
    finally:
        bench.run([*RAYLANE, "down"], env=env)


def _record(env: dict[str, str]) -> dict[str, Any]:
    return json.loads((Path(env["RAYLANE_HOME"]) / "cluster.json").read_text())


def _warm_of(env: dict[str, str]) -> int:
    return int(_record(env).get("warm", 0))


def _pool_ready(env: dict[str, str]) -> float:
    """Seconds waited until the head's pool is whole and quiet (its imports done)."""
    from raylane.onray.warmpool import idle_workers, process_cpu_s

    record, t0 = _record(env), time.monotonic()
    ref: tuple[set[int], float] | None = None
    since = t0
    while time.monotonic() - t0 < POOL_WAIT_S:
        pids = set(idle_workers(record["pid"]))
        now = (pids, sum(process_cpu_s(p) for p in pids))
        if ref is None or now[0] != ref[0] or now[1] - ref[1] > QUIET_CPU_S:
            ref, since = now, time.monotonic()
        elif len(pids) >= record["warm"] and time.monotonic() - since >= QUIET_FOR_S:
            break
        time.sleep(0.25)
    return round(time.monotonic() - t0, 1)
