"""A driver killed with SIGKILL (issue 47, finding 12): an embedded cluster's GCS and raylet die
with it, but Ray's dashboard and runtime-env agents outlived it by 1 to 5 minutes, and its
workers went on writing checkpoints for the 2 s they took to notice (10 of them, every 20 steps
of `regression`). Now the next launch stops what is left of the cluster, by pid, and a worker
checks that its driver is alive before each checkpoint."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from raylane.onray import leftovers
from raylane.onray.leftovers import ProcessId
from tests.conftest import session_processes, wait_for


def _holder(path) -> subprocess.Popen:
    """A process that keeps a file of a cluster's session folder open, as Ray's agents do."""
    code = f"f = open({str(path)!r}, 'a'); import time; time.sleep(600)"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _record(home, owner: ProcessId, session) -> None:
    folder = home / leftovers.RECORDS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{owner.pid}.json").write_text(json.dumps({**dataclasses.asdict(owner), "session_dir": str(session)}))


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_next_launch_stops_what_a_killed_drivers_cluster_left(tmp_path, monkeypatch, caplog):
    """Real processes in the places of Ray's: the stopping itself (make test; the whole of it on
    Ray is the slow test below). A dead driver's record whose pid a bystander has taken since:
    the processes holding files in its session folder stop, the bystander (the reused pid) and a
    live driver's cluster do not."""
    monkeypatch.setenv("RAYLANE_HOME", str(tmp_path / "home"))
    dead, live = tmp_path / "session_dead", tmp_path / "session_live"
    for session in (dead, live):
        (session / "logs").mkdir(parents=True)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    started = psutil.Process(bystander.pid).create_time()
    # The driver that had this pid before the bystander, and started its cluster a minute ago.
    owner = dataclasses.replace(ProcessId.here(), pid=bystander.pid, started_unix=started - 60)
    agents = [_holder(dead / "logs" / f"agent{i}.log") for i in range(2)]
    other = _holder(live / "logs" / "agent.log")
    procs = [bystander, *agents, other]
    try:
        wait_for(lambda: all(psutil.Process(p.pid).open_files() for p in [*agents, other]), timeout_s=60)
        _record(tmp_path / "home", owner, dead)
        _record(tmp_path / "home", ProcessId.here(), live)  # this process: a driver still running
        with caplog.at_level(logging.WARNING, logger="raylane"):
            assert sorted(leftovers.stop_leftovers()) == sorted(a.pid for a in agents)
        assert [r.getMessage() for r in caplog.records] == [
            f"stopped 2 Ray processes (python {min(a.pid for a in agents)}, python {max(a.pid for a in agents)}) "
            f"left by the embedded cluster of pid {owner.pid}, since "
            f"{time.strftime('%H:%M:%S', time.localtime(owner.started_unix))}, which ended without stopping it"
        ]
        assert not any(_running(a.pid) for a in agents)
        assert _running(bystander.pid) and _running(other.pid)
        assert [p.name for p in (tmp_path / "home" / leftovers.RECORDS).iterdir()] == [f"{os.getpid()}.json"]
        assert leftovers.stop_leftovers() == []  # said once
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


@pytest.mark.ray
@pytest.mark.untracked
@pytest.mark.slow  # an embedded cluster, killed, then another launch (~90 s); make test: the test above and tests/unit/test_leftovers.py
def test_a_killed_drivers_workers_write_no_more_checkpoints_and_the_next_launch_stops_its_agents(run_cli, tmp_path):
    """SIGKILL the driver of an embedded-cluster run mid-training (a checkpoint every 5 steps of
    a run of many): at most the checkpoint already in flight is committed after the kill, and
    the next launch (one process, --local) stops the agents with one line, before it trains."""
    args = ["train", "regression", "--set", "checkpoint.every_n_steps=5"]
    first = run_cli(
        *args,
        "--set",
        "run.name=killed",
        "--set",
        "train.max_epochs=100000",
        "--set",
        "checkpoint.keep=null",
        name="first",
    )
    run = tmp_path / "runs" / "killed"

    def committed() -> set[str]:
        return {p.parent.name for p in run.glob("checkpoint_*/manifest.json")}

    def left(prefix: str = "") -> list[int]:
        return [pid for pid in session_processes(first.proc.pid, prefix) if _running(pid)]

    wait_for(lambda: len(committed()) >= 3 or first.proc.poll() is not None, timeout_s=300)
    assert first.proc.poll() is None, first.output
    os.kill(first.proc.pid, signal.SIGKILL)
    at_kill = committed()
    first.proc.wait(30)
    # The workers end (Ray's own doing, a second or two after their raylet); then nothing moves.
    wait_for(lambda: not left("ray::RayTrainWorker"), timeout_s=120)
    assert len(committed() - at_kill) <= 1, sorted(committed() - at_kill)

    assert left(), "no agent outlived the driver: nothing for the next launch to stop"
    second = run_cli(*args, "--local", "--set", "run.name=next", "--set", "train.max_epochs=1", name="second")
    wait_for(lambda: "left by the embedded cluster of pid" in second.output or second.proc.poll() is not None, 120)
    said = [ln for ln in second.output.splitlines() if "left by the embedded cluster of pid" in ln]
    assert len(said) == 1 and said[0].startswith("stopped "), second.output
    assert f"of pid {first.proc.pid}, since " in said[0], said
    assert not left()
    assert second.wait(300) == 0, second.output
