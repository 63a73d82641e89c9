"""One run, one writer (raylane.lease): a second launch of a running run.name exits 2 naming the
holder; a lease whose holder is gone is taken over, with a line saying so."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import psutil
import pytest

from raylane import lease
from raylane.config import ConfigError
from tests.conftest import wait_for


def _holder(**changes) -> dict:
    me = psutil.Process()
    now = time.time()
    fields = {"host": socket.gethostname(), "pid": me.pid, "started_unix": me.create_time(), "taken_unix": now - 5,
              "heartbeat_unix": now - 1, "command": "raylane train digits", "token": "t" * 32}
    return {**fields, **changes}


def _leased(folder, **changes) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / lease.LEASE_FILE).write_text(json.dumps(_holder(**changes)))


def test_a_live_holder_refuses_a_second_launch(tmp_path):
    _leased(tmp_path / "r")
    with pytest.raises(ConfigError) as refused:
        lease.acquire(tmp_path / "r", "run 'r'", "run.name", "r", lambda: "r-2")
    text = str(refused.value)
    assert text.startswith(f"run.name = 'r': run 'r' is already running (pid {os.getpid()} on {socket.gethostname()}")
    assert "'raylane train digits'" in text and text.endswith("or start another with --set run.name=r-2")


@pytest.mark.parametrize("gone", [
    {"pid": 2**22 + 17},  # no such process on this host
    {"started_unix": 1.0},  # this pid, but a process started since: the pid was reused
    {"host": "another-host", "heartbeat_unix": time.time() - 2 * lease.STALE_S},  # no heartbeat for too long
])
def test_a_lease_whose_holder_is_gone_is_taken_over_with_a_line(tmp_path, caplog, gone):
    _leased(tmp_path / "r", **gone)
    with caplog.at_level("WARNING", logger="raylane"):
        held = lease.acquire(tmp_path / "r", "run 'r'", "run.name", "r", lambda: "r-2")
    assert "run 'r': took over the lease of pid" in caplog.text and "which is no longer running" in caplog.text
    assert json.loads((tmp_path / "r" / lease.LEASE_FILE).read_text())["pid"] == os.getpid()
    held.release()
    assert not (tmp_path / "r" / lease.LEASE_FILE).exists()


def test_another_hosts_fresh_heartbeat_holds(tmp_path):
    _leased(tmp_path / "r", host="another-host", pid=1)
    with pytest.raises(ConfigError, match="already running .pid 1 on another-host"):
        lease.acquire(tmp_path / "r", "run 'r'", "run.name", "r", lambda: "r-2")


def test_release_leaves_a_lease_taken_over_since(tmp_path):
    held = lease.acquire(tmp_path / "r", "run 'r'", "run.name", "r", lambda: "r-2")
    _leased(tmp_path / "r", token="x" * 32)  # another launch took it over (this one was thought gone)
    held.release()
    assert json.loads((tmp_path / "r" / lease.LEASE_FILE).read_text())["token"] == "x" * 32


@pytest.mark.untracked
def test_the_second_of_two_launches_of_one_run_name_exits_2(run_cli, tmp_path):
    """Two terminals, one run.name. Before, the second printed 'continued' and both trained into
    the same checkpoint folder and MLflow run."""
    args = ["train", "digits", "--local", "--set", "run.name=twice"]
    first = run_cli(*args, "--set", "train.max_epochs=200", name="first")
    wait_for(lambda: (tmp_path / "runs" / "twice" / lease.LEASE_FILE).exists() or first.proc.poll() is not None, 120)
    assert first.proc.poll() is None, first.output
    second = run_cli(*args, name="second")
    assert second.wait(60) == 2, second.output
    line = f"raylane: run.name = 'twice': run 'twice' is already running (pid {first.proc.pid} on {socket.gethostname()}"
    assert second.output.startswith(line) and len(second.output.strip().splitlines()) == 1, second.output
    # The holder crashes (no way out runs): its lease stays, naming a process that is gone.
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait(30)
    third = run_cli(*args, "--set", "train.max_epochs=1", "--set", "mlflow.enabled=false", name="third")
    assert third.wait(180) == 0, third.output
    assert f"run 'twice': took over the lease of pid {first.proc.pid} on {socket.gethostname()}" in third.output
    assert not (tmp_path / "runs" / "twice" / lease.LEASE_FILE).exists()  # given back at the end
