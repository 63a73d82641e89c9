"""raylane.onray.slurm, the node and the wait that scripts/slurm-ray.sbatch runs, without Slurm or
Ray (tests/e2e/test_slurm.py runs them under both): the `ray start` each node runs, a node that
outlives Slurm's SIGTERM to the whole job and stops on the script's SIGUSR1, and a head that
never answers failing the wait in one line within its bound."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
import time

from raylane.onray import slurm
from tests.conftest import wait_for


def test_each_node_runs_ray_with_what_slurm_gave_it_and_ports_of_its_own(monkeypatch):
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "48")
    head = slurm.node_argv(argparse.Namespace(head=True, ip="10.0.0.5", port=6390, address=None), "/tmp/x")
    assert head[1:3] == ["start", "--block"] and "--head" in head
    assert {"--port=6390", "--node-ip-address=10.0.0.5", "--num-gpus=4", "--num-cpus=48", "--temp-dir=/tmp/x"} <= set(
        head
    )
    ports = [a.split("=")[1] for a in head if a.startswith(("--dashboard-port", "--ray-client", "--dashboard-agent"))]
    assert len(set(ports)) == 3 and "8265" not in ports and "10001" not in ports and "52365" not in ports
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    worker = slurm.node_argv(argparse.Namespace(head=False, ip=None, port=6379, address="10.0.0.5:6390"), "/tmp/x")
    assert "--address=10.0.0.5:6390" in worker and "--head" not in worker and "--num-gpus=0" in worker


# A node whose `ray start` is a stand-in that reports, as Ray's processes would inherit it,
# whether SIGTERM is blocked, then waits to be stopped.
NODE = textwrap.dedent(
    """
    import sys
    from raylane.onray import slurm
    probe = [sys.executable, "-c",
             "import signal, time; print('blocked:', sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])), flush=True); time.sleep(600)"]
    slurm.node_argv = lambda args, temp: probe
    sys.exit(slurm.main(["node", "--address", "127.0.0.1:1"]))
    """
)


def test_a_node_outlives_the_jobs_sigterm_and_stops_on_sigusr1(tmp_path):
    """Slurm's SIGTERM reaches every process of the job: the node and what it started hold it
    (pending, not acted on), so the cluster stays up while the driver has the ranks checkpoint;
    the batch script's SIGUSR1 then stops the node and everything it started."""
    log = open(tmp_path / "node.log", "w")
    node = subprocess.Popen([sys.executable, "-c", NODE], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        blocked = wait_for(lambda: "blocked:" in (tmp_path / "node.log").read_text(), timeout_s=30)
        assert blocked
        line = next(ln for ln in (tmp_path / "node.log").read_text().splitlines() if ln.startswith("blocked:"))
        assert f"<Signals.SIGTERM: {signal.SIGTERM}>" in line and f"<Signals.SIGUSR1: {signal.SIGUSR1}>" in line
        ray_start = _children(node.pid)
        assert len(ray_start) == 1
        for pid in (node.pid, *ray_start):
            os.kill(pid, signal.SIGTERM)  # as scancel does, to every process
        time.sleep(1)
        assert node.poll() is None and _alive(ray_start[0])
        os.kill(node.pid, signal.SIGUSR1)
        assert node.wait(timeout=30) == 0
        assert not _alive(ray_start[0])
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        log.close()


def test_a_head_that_never_answers_fails_the_wait_in_one_line():
    start = time.monotonic()
    port = _closed_port()
    line = slurm.wait_for_nodes(f"127.0.0.1:{port}", 2, 1.0, ["a", "b"])
    assert (
        line == f"raylane slurm: the Ray head at 127.0.0.1:{port} did not start within 1 s (its srun output is above)"
    )
    assert time.monotonic() - start < 5


def test_a_node_whose_ray_did_not_start_ends_the_wait_at_once():
    """Its srun task has ended (Ray failed on that node): the wait says so in one line without
    sitting out its bound."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    start = time.monotonic()
    line = slurm.wait_for_nodes(f"127.0.0.1:{_closed_port()}", 2, 60.0, ["a", "b"], {ended.pid: "b"})
    assert line == "raylane slurm: the Ray node on b ended before the cluster was up (its srun output is above)"
    assert time.monotonic() - start < 5


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
