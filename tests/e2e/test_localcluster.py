"""`raylane up` / `raylane down`: a persistent token-authenticated head that later runs join, and
that `down` stops completely, by its processes' ids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import cli_env, read_json, session_processes, wait_for

pytestmark = pytest.mark.ray


def _running(pids: list[int]) -> list[int]:
    """Those of `pids` still running: a zombie has exited (a container's init may never reap it)."""
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] != "Z":
            alive.append(pid)
    return alive


def _usage(address: str, env: dict[str, str]) -> str:
    """The head's resource usage line, as `ray status` prints it (e.g. " 2.0/3.0 CPU ...")."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "status", "--address", address],
        check=False,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return out.split("Total Usage:", 1)[-1].split("\n", 2)[1] if "Total Usage:" in out else ""


@pytest.mark.slow  # ~45 s; make test's shared head is started by raylane up and stopped by raylane down
def test_up_then_a_run_joins_it_and_down_stops_every_process(run_cli, tmp_path):
    token = tmp_path / "auth_token"
    token.write_text(uuid.uuid4().hex)
    token.chmod(0o600)
    env = cli_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    home = tmp_path / "raylane-home"

    up = run_cli("up", "--num-cpus", "3", env=env, name="up")
    assert up.wait(180) == 0, up.output
    state = json.loads((home / "cluster.json").read_text())
    assert state["address"].startswith("127.0.0.1:") and state["num_cpus"] == 3
    head_pids = session_processes(state["pid"])
    assert len(head_pids) > 2  # ray start, GCS, raylet, dashboard, ...

    again = run_cli("up", env=env, name="again")
    assert again.wait(60) == 0 and f"already running: a local Ray head at {state['address']}" in again.output

    run = run_cli(
        "train",
        "regression",
        "--set",
        "train.max_steps=3",
        "--set",
        "mlflow.enabled=false",
        "--summary-json",
        "s.json",
        env=env,
        name="joined",
    )
    assert run.wait(300) == 0, run.output
    assert f"joining the local Ray head at {state['address']}" in run.output
    assert read_json(tmp_path / "s.json")["status"] == "FINISHED"
    assert not run.session_pids()  # the run started no Ray of its own: nothing of it outlives it

    # A joined driver killed mid-run leaves no resources held: its job ends, and Ray removes the
    # job's placement group (a `raylane train` run starts no placement-group cleaner actor).
    killed = run_cli(
        "train",
        "regression",
        "--set",
        "train.max_epochs=100000",
        "--set",
        "mlflow.enabled=false",
        "--set",
        "run.name=killed",
        env=env,
        name="killed",
    )
    wait_for(lambda: "epoch 1 eval" in killed.output, timeout_s=240)
    assert "2.0/3.0 CPU" in _usage(state["address"], env)
    os.kill(killed.proc.pid, signal.SIGKILL)
    wait_for(lambda: "0.0/3.0 CPU" in _usage(state["address"], env), timeout_s=60, interval_s=1)

    down = run_cli("down", env=env, name="down")
    assert down.wait(120) == 0 and f"stopped the local Ray head at {state['address']}" in down.output
    assert not _running(head_pids) and not _running(session_processes(state["pid"]))
    assert not (home / "cluster.json").exists()
    assert not Path(state["temp_dir"]).exists()  # Ray's session files and the jobs' working directories
    gone = run_cli("down", env=env, name="gone")
    assert gone.wait(60) == 0 and "no local Ray head is running" in gone.output
