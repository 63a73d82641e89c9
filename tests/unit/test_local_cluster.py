"""raylane.clusters.local's view of processes and ports (issue 61): psutil where it read /proc, and
one probe for "does something listen there" (raylane.clusters.addresses.listening) where local.py
and raylane.onray.slurm each had their own. Each is compared with the code it replaced, kept here
as it was, on real processes of this machine. A head's whole life is tests/e2e/test_localcluster.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from raylane.clusters import addresses, local
from tests.conftest import wait_for


def proc_session_pids(sid: int) -> list[int]:
    """local.session_pids before issue 61: /proc read by hand."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def proc_listening(address: str) -> bool:
    """local._listening before issue 61 (onray.slurm's was the same connect, by host and port)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def test_a_sessions_processes_are_those_the_proc_reader_found():
    """A session of its own, as a head's: its leader, a child, a grandchild, and a child that
    exited unreaped (a zombie: not counted, as before); then stopped by pid, and empty."""
    code = (
        "import subprocess, time\n"
        "done = subprocess.Popen(['true'])\n"  # kept, never waited for: a zombie
        "kids = subprocess.Popen(['sh', '-c', 'sleep 60 & wait'])\n"
        "time.sleep(60)\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        sid = leader.pid
        wait_for(lambda: len(proc_session_pids(sid)) == 3, timeout_s=30)  # python, sh, sleep
        zombies = [p.pid for p in psutil.Process(sid).children() if p.status() == psutil.STATUS_ZOMBIE]
        assert len(zombies) == 1
        found = local.session_pids(sid)
        assert sorted(found) == sorted(proc_session_pids(sid)) and sid in found and zombies[0] not in found
        assert os.getpid() not in found
        local.stop_session(sid)
        leader.wait(10)
        assert local.session_pids(sid) == [] == proc_session_pids(sid)
    finally:
        if leader.poll() is None:
            local.stop_session(leader.pid)
            leader.wait(10)


def test_one_probe_says_whether_something_listens_as_each_old_one_did():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert addresses.listening("127.0.0.1", port) is True is proc_listening(f"127.0.0.1:{port}")
    assert addresses.listening("127.0.0.1", port) is False is proc_listening(f"127.0.0.1:{port}")


def test_a_recorded_head_counts_only_while_its_process_lives_and_its_gcs_port_listens(monkeypatch, tmp_path):
    monkeypatch.setenv("RAYLANE_HOME", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        for pid, expected in ((os.getpid(), True), (gone.pid, False)):
            _record(tmp_path, pid, f"127.0.0.1:{port}")
            assert (local.running() is not None) is expected, pid
    _record(tmp_path, os.getpid(), f"127.0.0.1:{port}")
    assert local.running() is None  # its port closed: a record left by a head that died


def _record(home: Path, pid: int, address: str) -> None:
    record = dict(
        address=address,
        dashboard_url="http://127.0.0.1:2",
        pid=pid,
        temp_dir="/tmp/raylane-x",
        num_cpus=4,
        started_unix=0.0,
        log="head.log",
    )
    (home / local.STATE_FILE).write_text(json.dumps(record))
