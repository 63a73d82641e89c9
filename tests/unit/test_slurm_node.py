"""raylane.onray.slurm, the node and the wait that scripts/slurm-ray.sbatch runs, without Slurm or
Ray (tests/e2e/test_slurm.py runs them under both): the `ray start` each node runs, a node that
outlives Slurm's SIGTERM to the whole job and stops on the script's SIGUSR1, a head that never
answers failing the wait in one line within its bound, the Slurm nodes that line names, the
script's settings refused before any node starts, and `raylane slurm init`."""

from __future__ import annotations

import argparse
import glob
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib

from raylane import cli
from raylane.clusters import slurm as kit
from raylane.config import ConfigError
from raylane.onray import slurm
from tests.conftest import REPO, wait_for


def test_each_node_runs_ray_with_what_slurm_gave_it_and_ports_of_its_own(monkeypatch):
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "4")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "48")
    head = slurm.node_argv(argparse.Namespace(head=True, ip="10.0.0.5", port=6390, address=None), "/tmp/x")
    assert head[1] == "start" and "--head" in head
    assert {"--port=6390", "--node-ip-address=10.0.0.5", "--num-gpus=4", "--num-cpus=48", "--temp-dir=/tmp/x"} <= set(
        head
    )
    ports = [a.split("=")[1] for a in head if a.startswith(("--dashboard-port", "--ray-client", "--dashboard-agent"))]
    assert len(set(ports)) == 3 and "8265" not in ports and "10001" not in ports and "52365" not in ports
    assert "--block" not in head  # run_node watches the node: one of Ray's helpers exiting does not end it
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-017")
    worker = slurm.node_argv(argparse.Namespace(head=False, ip=None, port=6379, address="10.0.0.5:6390"), "/tmp/x")
    assert "--address=10.0.0.5:6390" in worker and "--head" not in worker and "--num-gpus=0" in worker
    assert f"--labels={kit.NODE_LABEL}=gpu-017" in worker  # Slurm's name for it, which the wait names


def test_the_wait_names_the_slurm_nodes_by_their_label_else_their_hostname():
    def node(host: str, label: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(node_manager_hostname=host, labels={kit.NODE_LABEL: label} if label else {})

    hosts = ["gpu-001", "gpu-002", "gpu-003"]
    # NodeHostname differs from Slurm's NodeName: the label says which node it is.
    assert slurm.not_joined(hosts, [node("ip-10-0-0-5.ec2.internal", "gpu-001")]) == ["gpu-002", "gpu-003"]
    # No label (a node started otherwise): its short hostname.
    assert slurm.not_joined(hosts, [node("gpu-001.cluster"), node("x", "gpu-003")]) == ["gpu-002"]


@pytest.mark.parametrize(
    ("env", "line"),
    [
        (
            {"RAYLANE_RAY_PORT": "16379"},
            "RAYLANE_RAY_PORT = 16379: inside Ray's worker port range 10002-19999, where each node's workers "
            "take their ports; choose one outside it (6379 by default)",
        ),
        ({"RAYLANE_RAY_PORT": "10002"}, "RAYLANE_RAY_PORT = 10002: inside Ray's worker port range"),
        ({"RAYLANE_RAY_PORT": "19999"}, "RAYLANE_RAY_PORT = 19999: inside Ray's worker port range"),
        ({"RAYLANE_RAY_PORT": "70000"}, "RAYLANE_RAY_PORT = '70000': not a port (1-65535)"),
        ({"RAYLANE_RAY_PORT": "63 79"}, "RAYLANE_RAY_PORT = '63 79': not a port (1-65535)"),
        ({"RAYLANE_NODES_TIMEOUT_S": "5m"}, "RAYLANE_NODES_TIMEOUT_S = '5m': not a number of seconds above 0"),
        ({"RAYLANE_JOIN_TIMEOUT_S": "0"}, "RAYLANE_JOIN_TIMEOUT_S = '0': not a number of seconds above 0"),
    ],
)
def test_the_scripts_settings_are_refused_in_one_line_naming_the_variable(env, line):
    with pytest.raises(ConfigError) as caught:
        kit.check_settings(env)
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value)


def test_ports_beside_rays_worker_range_and_the_defaults_pass():
    for port in ("6379", "10001", "20000", "65535"):
        kit.check_settings({"RAYLANE_RAY_PORT": port, "RAYLANE_NODES_TIMEOUT_S": "30.5"})
    kit.check_settings({})  # the script's defaults


def test_the_refused_range_is_ray_starts_own():
    from ray.scripts.scripts import start

    defaults = {p.name: p.default for p in start.params}
    assert kit.RAY_WORKER_PORTS == (defaults["min_worker_port"], defaults["max_worker_port"])


def test_the_preflight_exits_2_with_one_line(monkeypatch, capsys):
    monkeypatch.setenv("RAYLANE_RAY_PORT", "16379")
    assert slurm.main(["preflight"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raylane slurm: RAYLANE_RAY_PORT = 16379: inside Ray's worker port range 10002-19999")
    assert err.count("\n") == 1
    monkeypatch.setenv("RAYLANE_RAY_PORT", "6390")
    assert slurm.main(["preflight"]) == 0


def test_a_join_that_fails_under_slurm_points_at_the_heads_srun_output_not_raylane_up(monkeypatch):
    from raylane.clusters.addresses import join_hint

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert "`raylane up` prints it" in join_hint("--address")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    hint = join_hint("--address")
    assert hint == (
        "under Slurm (job 4242) the head's srun output says why it did not answer; "
        "RAYLANE_JOIN_TIMEOUT_S gives a slow head longer"
    )


def test_slurm_init_writes_the_shipped_script_and_never_overwrites(tmp_path, capsys):
    assert cli.main(["slurm", "init", str(tmp_path / "kit")]) == 0
    script = tmp_path / "kit" / "slurm-ray.sbatch"
    assert script.read_bytes() == (REPO / "scripts" / "slurm-ray.sbatch").read_bytes()
    assert os.access(script, os.X_OK) and script.read_text().startswith("#!/usr/bin/env bash\n")
    assert f"wrote {script}; from your project: sbatch --nodes=2 {script} CONFIG" in capsys.readouterr().out
    script.write_text("# my edits\n")
    assert cli.main(["slurm", "init", str(tmp_path / "kit")]) == 2
    assert capsys.readouterr().err == (
        f"raylane: slurm init: {script} exists; nothing was written (move it, or choose another folder)\n"
    )
    assert script.read_text() == "# my edits\n"
    (tmp_path / "file").write_text("")
    assert cli.main(["slurm", "init", str(tmp_path / "file")]) == 2


def test_the_script_ships_as_package_data():
    """pyproject's package-data glob for raylane.clusters, expanded as setuptools does, holds the
    script that scripts/ links to (a checkout's path, in the docs and tests)."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    package = REPO / "app" / "raylane" / "clusters"
    matched = {Path(p) for pattern in data["raylane.clusters"] for p in glob.glob(str(package / pattern))}
    assert kit.SCRIPT in matched and kit.SCRIPT.parent == package
    assert (REPO / "scripts" / "slurm-ray.sbatch").resolve() == kit.SCRIPT


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


# A node whose `ray start` is a shell line: it may leave a process named `raylet` (a copy of
# sleep) in the node's session, and exits with a code of its own.
FAKE_RAY_START = textwrap.dedent(
    """
    import sys
    from raylane.onray import slurm
    slurm.NODE_CHECK_S = 0.2
    slurm.node_argv = lambda args, temp: ["sh", "-c", sys.argv[1]]
    sys.exit(slurm.main(["node", "--address", "127.0.0.1:1"]))
    """
)


def _fake_node(tmp_path, line: str) -> subprocess.Popen:
    raylet = tmp_path / "raylet"
    raylet.write_bytes(Path("/bin/sleep").read_bytes())
    raylet.chmod(0o755)
    return subprocess.Popen(
        [sys.executable, "-c", FAKE_RAY_START, line.replace("RAYLET", str(raylet))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_a_node_ends_with_ray_starts_code_when_no_raylet_started(tmp_path):
    node = _fake_node(tmp_path, "exit 3")  # `ray start` failed before its raylet (a bad flag, a port taken)
    out, _ = node.communicate(timeout=60)
    assert node.returncode == 3 and out == "raylane slurm: stopping the Ray node on " + os.uname().nodename + "\n"


def test_a_node_outlives_ray_start_giving_up_while_its_raylet_lives_and_ends_with_it(tmp_path):
    """`ray start` gives a raylet 30 s to register and then exits 1, leaving it running: the node
    goes on (the batch script's wait is the bound), and ends when its raylet does."""
    node = _fake_node(tmp_path, "RAYLET 4 & exit 1")
    try:
        out, _ = node.communicate(timeout=60)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    assert node.returncode == 1
    assert out.splitlines()[0].startswith("raylane slurm: `ray start` gave up on the node on ")
    assert out.splitlines()[-1].startswith("raylane slurm: stopping the Ray node on ")
    node = _fake_node(tmp_path, "RAYLET 4 & exit 0")  # started; then its raylet exits: the node died
    out, _ = node.communicate(timeout=60)
    assert node.returncode == 1 and "raylane slurm: the Ray node on " in out and "died (its raylet exited)" in out


def test_a_head_that_never_answers_fails_the_wait_in_one_line():
    start = time.monotonic()
    port = _closed_port()
    line = slurm.wait_for_nodes(f"127.0.0.1:{port}", 2, 1.0, ["a", "b"])
    assert line == (
        f"raylane slurm: the Ray head on a (127.0.0.1:{port}) did not start within 1 s (RAYLANE_NODES_TIMEOUT_S); "
        "its srun output is above"
    )
    assert time.monotonic() - start < 5


def test_a_port_that_listens_but_never_speaks_grpc_fails_the_wait_as_a_head_not_started():
    """Something accepts on the port and says nothing (a head's GCS hung, another program): asked
    with gRPC until the bound, then the same one line."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        line = slurm.wait_for_nodes(address, 1, 2.0, ["node-a"])
    assert line == (
        f"raylane slurm: the Ray head on node-a ({address}) did not start within 2 s (RAYLANE_NODES_TIMEOUT_S); "
        "its srun output is above"
    )
    assert time.monotonic() - start < 10


def test_a_node_whose_ray_did_not_start_ends_the_wait_at_once():
    """Its srun task has ended (Ray failed on that node): the wait says so in one line without
    sitting out its bound."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    start = time.monotonic()
    line = slurm.wait_for_nodes(f"127.0.0.1:{_closed_port()}", 2, 60.0, ["a", "b"], {ended.pid: "b"})
    assert line == "raylane slurm: the Ray node on b ended before the cluster was up (its srun output is above)"
    assert time.monotonic() - start < 5


def test_an_ended_srun_task_is_told_as_the_proc_reader_told_it():
    """A node's srun task, as the wait sees it through psutil (issue 61), against the /proc reader it
    replaced: running, exited but not yet reaped by the batch script (a zombie), and reaped."""
    import psutil

    running = subprocess.Popen(["sleep", "30"])
    unreaped = subprocess.Popen(["true"])
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    try:
        wait_for(lambda: psutil.Process(unreaped.pid).status() == psutil.STATUS_ZOMBIE, timeout_s=30)
        for pid, ended in ((running.pid, False), (unreaped.pid, True), (reaped.pid, True)):
            assert (slurm._ended({pid: "b"}) is not None) is ended is _proc_ended(pid), pid
    finally:
        running.kill()
        running.wait()
        unreaped.wait()


def _proc_ended(pid: int) -> bool:
    """slurm._ended's test before issue 61: /proc read by hand."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        state = "gone"
    return state in ("Z", "gone")


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
