"""The warm pool's view of the head's processes through psutil (issue 52's /proc reads, replaced in
issue 60 and split out in issue 61: raylane.onray.warmpool), against the /proc reader it replaced,
kept here as it was, on real processes: a worker still starting, one Ray retitled idle, this one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raylane.clusters import local
from raylane.onray import warmpool


def proc_idle_workers(sid: int, starting: bool = False) -> list[int]:
    """warm.idle_workers before issue 60: each worker's /proc/PID/cmdline read by hand."""
    found = []
    for pid in local.session_pids(sid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        launching = any(arg.endswith(b"default_worker.py") for arg in cmdline.split(b"\0")[:4])
        if cmdline.startswith(b"ray::IDLE") or (starting and launching):
            found.append(pid)
    return found


def proc_cpu_s(pid: int) -> float:
    """warm.process_cpu_s before issue 60."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


@pytest.fixture
def workers(tmp_path, monkeypatch):
    """(starting, idle): a process run as Ray starts a worker (`python .../default_worker.py ...`),
    and one retitled `ray::IDLE` by Ray's own setproctitle, as a registered idle worker is."""
    script = tmp_path / "default_worker.py"
    script.write_text("import time\ntime.sleep(120)\n")
    title = "import time, ray._raylet as r\nr.setproctitle('ray::IDLE')\nprint('idle', flush=True)\ntime.sleep(120)\n"
    starting = subprocess.Popen([sys.executable, "-u", str(script), "--node-ip-address=127.0.0.1"])
    idle = subprocess.Popen([sys.executable, "-c", title], stdout=subprocess.PIPE, text=True)
    try:
        assert idle.stdout is not None and idle.stdout.readline() == "idle\n"
        pids = [starting.pid, idle.pid, os.getpid()]
        monkeypatch.setattr(local, "session_pids", lambda sid: pids)
        monkeypatch.setenv("RAYLANE_HOME", str(tmp_path))
        yield starting.pid, idle.pid
    finally:
        for proc in (starting, idle):
            proc.kill()
            proc.wait()


def test_the_pool_tells_idle_and_starting_workers_as_the_proc_reader_did(workers):
    starting, idle = workers
    for also_starting in (False, True):
        assert warmpool.idle_workers(1, also_starting) == sorted(proc_idle_workers(1, also_starting))
    assert warmpool.idle_workers(1, starting=True) == sorted([starting, idle])
    mark_ready(idle, "")  # ready: marked by raylane.onray.preload
    assert warmpool.pool_workers(1) == ([idle], [], [starting])


def mark_ready(pid: int, state: str) -> None:
    folder = Path(os.environ["RAYLANE_HOME"]) / "warm" / "ready"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(pid)).write_text(state)


def test_a_processs_cpu_seconds_are_those_the_proc_reader_counted():
    gone = subprocess.Popen(["true"])
    gone.wait()
    sum(i * i for i in range(2_000_000))  # some CPU of this process's own
    before = proc_cpu_s(os.getpid())
    psutils = warmpool.process_cpu_s(os.getpid())
    after = proc_cpu_s(os.getpid())
    # psutil adds user and system time as floats (114.55000000000001 against the reader's 114.55
    # in a fresh-clone make test): equal within far less than a clock tick.
    assert 0 < before <= psutils + 1e-6 and psutils <= after + 1e-6
    assert warmpool.process_cpu_s(gone.pid) == 0.0 == proc_cpu_s(gone.pid)
