"""Warm workers on a `raylane up` head (issue 52), end to end: a run lands on the head's warm
workers, says so, and trains exactly as a cold run does; the pool is refilled after it, never
beyond its size; workers that imported older raylane code are recycled, and that run starts cold.
On a head kept busy by two processes spinning (issue 60: the pool used to wait for a quiet
machine, and never filled), `raylane up --warm` says its workers are starting, the pool fills
within FILL_S, `raylane up` says how many are ready, and a run on it reports its warm actors.
The decisions themselves are proven in-process: tests/unit/test_warm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from raylane.onray.warmpool import idle_workers, pool_workers, ready_workers
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


# The bound a busy 2-core head's pool is given here: measured 7 workers in ~2 min beside two
# spinning processes (docs/clusters.md); generous for a shared machine under the suite's load.
FILL_S = 420


def _pool_ready(sid: int, size: int = POOL, timeout_s: float = FILL_S) -> list[int]:
    """The head's warm workers once `size` of them have imported (each marks itself ready)."""

    def ready() -> list[int] | None:
        found = ready_workers(sid)
        return found if len(found) >= size else None

    return wait_for(ready, timeout_s=timeout_s, interval_s=0.5)


@contextmanager
def _busy_machine(n: int = 2):
    """`n` processes spinning flat out, as others' work keeps a shared head busy: started here,
    ended by their pids."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def _head_env(tmp_path: Path, monkeypatch) -> dict[str, str]:
    token = tmp_path / "auth_token"
    token.write_text(uuid.uuid4().hex)
    token.chmod(0o600)
    env = cli_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    monkeypatch.setenv("RAYLANE_HOME", env["RAYLANE_HOME"])  # where the pool's workers mark themselves
    return env


@pytest.mark.slow  # ~30 s: a head started beside two spinners; make test fills, tops up and budgets the pool in-process (the tests below)
def test_a_busy_heads_pool_fills_and_up_says_what_it_has(run_cli, tmp_path, monkeypatch):
    """The machine is kept busy from the moment `raylane up` returns, when its pool starts to
    fill (the head's own start is Ray's, which on 2 cores beside two spinners can outlast Ray's
    own 30 s for a raylet to register)."""
    env = _head_env(tmp_path, monkeypatch)
    up = run_cli("up", "--num-cpus", "3", "--warm", "2", env=env, name="up")
    try:
        assert up.wait(240) == 0, up.output
        with _busy_machine():
            assert "2 warm workers starting (`raylane up` again says how many are ready)" in up.output
            head = json.loads((tmp_path / "raylane-home" / "cluster.json").read_text())
            start = time.monotonic()
            ready = _pool_ready(head["pid"], size=2)
            took = time.monotonic() - start
            again = run_cli("up", env=env, name="again")
            assert again.wait(120) == 0 and "2 of 2 warm workers ready, dashboard" in again.output, again.output
            time.sleep(2)  # whole: the top-up asks for no more
            assert sorted(ready_workers(head["pid"])) == sorted(ready) and not sum(pool_workers(head["pid"])[1:], [])
            print(f"2 warm workers ready {took:.1f} s after `raylane up` returned, beside 2 spinning processes")
    finally:
        down = run_cli("down", env=env, name="down")
        assert down.wait(120) == 0, down.output


@pytest.mark.slow  # ~6 min on 2 cores kept busy: a pool of 7 filled, two runs, a refill between
def test_on_a_busy_head_the_pool_fills_and_runs_land_on_it(run_cli, tmp_path, monkeypatch):
    env = _head_env(tmp_path, monkeypatch)
    up = run_cli("up", "--num-cpus", "3", "--warm", str(POOL), env=env, name="up")
    try:
        assert up.wait(240) == 0 and f"{POOL} warm workers starting" in up.output, up.output
        head = json.loads((tmp_path / "raylane-home" / "cluster.json").read_text())
        with _busy_machine():
            for attempt in range(2):  # the second finds the pool the first run's end refilled
                start = time.monotonic()
                pool = _pool_ready(head["pid"])
                print(
                    f"pool of {POOL} ready {time.monotonic() - start:.1f} s after {'up' if not attempt else 'the run'}"
                )
                run = run_cli("train", "regression", *_sets(), "--summary-json", f"{attempt}.json", env=env)
                assert run.wait(600) == 0, run.output
                assert f"warm start: {POOL} warm workers ready on the head" in run.output
                actors = read_json(tmp_path / f"{attempt}.json")["timing"]["warm_actors"]
                assert set(actors) == {"controller", "event sink", "rank 0", "rank 1"} and all(actors.values()), actors
                assert "4 of 4 actors started on warm workers" in run.output
                assert len(set(pool) - set(ready_workers(head["pid"]))) >= 4  # it took them
    finally:
        down = run_cli("down", env=env, name="down")
        assert down.wait(120) == 0, down.output


@pytest.mark.slow  # ~3 min on 2 cores: a head, its pool's imports, three runs and a refill
def test_a_warm_run_says_so_and_equals_a_cold_one_bit_for_bit(run_cli, tmp_path, monkeypatch):
    env = _head_env(tmp_path, monkeypatch)
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
        assert f"warm start: {POOL} warm workers ready on the head" in warm.output
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
