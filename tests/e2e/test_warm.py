"""Warm workers on a `raylane up` head (issue 52), end to end: a run lands on the head's warm
workers, says so, and trains exactly as a cold run does; the pool is refilled after it, never
beyond its size; workers that imported older raylane code are recycled, and that run starts cold.
The decisions themselves are proven in-process: tests/unit/test_warm.py."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from raylane.onray.warm import idle_workers, process_cpu_s
from tests.conftest import cli_env, read_json, wait_for

pytestmark = pytest.mark.ray

POOL = 7  # 2 ranks, the controller, the sync actor, the event sink, Ray Train's state actor (a first run), 1 spare
SETS = [
    "train.max_steps=6",
    "mlflow.enabled=false",
    "scaling.num_workers=2",
    "checkpoint.every_n_steps=0",
    "checkpoint.every_n_epochs=0",
    "train.eval_every_n_epochs=0",
]


def _pool_ready(sid: int, timeout_s: float = 300) -> list[int]:
    """The head's idle workers once POOL of them exist and together used under 0.1 s of CPU in
    the last 2 s: their imports are done (an idle worker's threads use a little CPU)."""
    ref: tuple[set[int], float] | None = None
    since = time.monotonic()

    def ready() -> list[int] | None:
        nonlocal ref, since
        pids = set(idle_workers(sid))
        now = (pids, sum(process_cpu_s(p) for p in pids))
        if ref is None or now[0] != ref[0] or now[1] - ref[1] > 0.1:
            ref, since = now, time.monotonic()
        return sorted(pids) if len(pids) >= POOL and time.monotonic() - since >= 2 else None

    return wait_for(ready, timeout_s=timeout_s, interval_s=0.25)


@pytest.mark.slow  # ~3 min on 2 cores: a head, its pool's imports, three runs and a refill
def test_a_warm_run_says_so_and_equals_a_cold_one_bit_for_bit(run_cli, tmp_path):
    token = tmp_path / "auth_token"
    token.write_text(uuid.uuid4().hex)
    token.chmod(0o600)
    env = cli_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    up = run_cli("up", "--num-cpus", "3", "--warm", str(POOL), env=env, name="up")
    assert up.wait(180) == 0 and f"{POOL} warm workers" in up.output, up.output
    head = json.loads((tmp_path / "raylane-home" / "cluster.json").read_text())
    try:
        pool = _pool_ready(head["pid"])
        assert len(pool) == POOL

        cold = run_cli("train", "regression", *_sets(), "--address", "local", "--summary-json", "cold.json", env=env)
        assert cold.wait(400) == 0, cold.output
        warm = run_cli("train", "regression", *_sets(), "--summary-json", "warm.json", env=env, name="warm")
        assert warm.wait(400) == 0, warm.output
        assert f"warm start: {POOL} idle warm workers on the head" in warm.output
        cold_s, warm_s = read_json(tmp_path / "cold.json"), read_json(tmp_path / "warm.json")
        actors = warm_s["timing"]["warm_actors"]
        assert set(actors) == {"controller", "event sink", "rank 0", "rank 1"} and all(actors.values()), actors
        assert "4 of 4 actors started on warm workers" in warm.output
        assert not any(cold_s["timing"]["warm_actors"].values())  # an embedded cluster has none
        _same_training(cold_s, warm_s)

        # The run's end asked for as many as it took: the pool is whole again, and no bigger.
        refilled = _pool_ready(head["pid"])
        assert len(refilled) == POOL and len(set(refilled) - set(pool)) >= 4

        # raylane's code edited since the pool started: its workers are recycled, the run is cold.
        source = Path(__import__("raylane").__file__).with_name("version.py")
        os.utime(source)
        stale = run_cli("train", "regression", *_sets(), "--summary-json", "stale.json", env=env, name="stale")
        assert stale.wait(400) == 0, stale.output
        assert "starting cold: raylane's code changed" in stale.output
        stale_s = read_json(tmp_path / "stale.json")
        assert not any(stale_s["timing"]["warm_actors"].values())
        assert not set(idle_workers(head["pid"])) & set(refilled)  # recycled
        _same_training(cold_s, stale_s)
    finally:
        down = run_cli("down", env=env, name="down")
        assert down.wait(120) == 0, down.output


def _sets() -> list[str]:
    return [x for s in SETS for x in ("--set", s)]


def _same_training(a: dict, b: dict) -> None:
    """The same run: every metric and the last window's figures equal, as floats, bit for bit."""
    assert a["steps"] == b["steps"] == 6
    assert a["metrics"] == b["metrics"] and a["metrics"], (a["metrics"], b["metrics"])
    losses = [k for k in a["metrics"] if "loss" in k]
    assert losses, a["metrics"]
