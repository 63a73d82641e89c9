"""One run, one writer (raylane.lease): a second launch of a running run.name exits 2 naming the
holder; a lease whose holder is gone is taken over, with a line saying so."""

from __future__ import annotations

import json
import os
import socket
import time

import psutil
import pytest

from raylane import lease
from raylane.config import ConfigError


def _holder(**changes) -> dict:
    me = psutil.Process()
    now = time.time()
    fields = {
        "host": socket.gethostname(),
        "pid": me.pid,
        "started_unix": me.create_time(),
        "taken_unix": now - 5,
        "heartbeat_unix": now - 1,
        "command": "raylane train digits",
        "token": "t" * 32,
    }
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


@pytest.mark.parametrize(
    "gone",
    [
        {"pid": 2**22 + 17},  # no such process on this host
        {"started_unix": 1.0},  # this pid, but a process started since: the pid was reused
        {"host": "another-host", "heartbeat_unix": time.time() - 2 * lease.STALE_S},  # no heartbeat for too long
    ],
)
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
