"""Joining a Ray cluster that never answers: a port where something accepts the connection and then
says nothing, as a wrong port or a hung head does. (Where nothing listens at all, the command
stops before anything starts: tests/e2e/test_bad_input.py.) Each run gives up with one line, or stops
at once on SIGTERM, and its MLflow run (or sweep's parent run) is closed, never left RUNNING."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, read_json, wait_for

pytestmark = pytest.mark.ray


class SilentPeer:
    """A TCP listener that accepts every connection and never sends a byte. On the address Ray
    connects to: Ray turns a loopback address into the host's own, so both use that one."""

    def __init__(self) -> None:
        from ray._private.services import get_node_ip_address  # Ray's choice of the host's address

        self.sock = socket.socket()
        self.sock.bind((get_node_ip_address(), 0))
        self.sock.listen(64)
        host, port = self.sock.getsockname()
        self.address = f"{host}:{port}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent_peer():
    peer = SilentPeer()
    yield peer
    peer.close()


def _tracked(tmp_path: Path) -> tuple[dict[str, str], str]:
    """The CLI's environment, and its MLflow store with its tables made: a new database takes
    seconds to set up on a busy machine, so the run is open well before the wait is over."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return cli_env(tmp_path), uri


def _statuses(uri: str) -> list[str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return [r.info.status for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]


# tune and autotune join through the same code as train (onray.cluster.join): make test-all.
@pytest.mark.parametrize(
    "command",
    [
        ["train", "digits"],
        pytest.param(["tune", "digits-sweep"], marks=pytest.mark.slow),
        pytest.param(["autotune", "digits"], marks=pytest.mark.slow),
    ],
)
def test_a_cluster_that_never_answers_is_given_up_on_within_the_join_timeout(command, run_cli, tmp_path, silent_peer):
    env, uri = _tracked(tmp_path)
    env["RAYLANE_JOIN_TIMEOUT_S"] = "3"  # 10 by default: the same code, 7 s sooner
    started = time.monotonic()
    cli = run_cli(*command, "--address", silent_peer.address, env=env)
    code = cli.wait(120)
    took = time.monotonic() - started
    mine = [line for line in cli.output.splitlines() if line.startswith("raylane")]
    assert code == 2, cli.output
    assert mine == [
        (
            f"raylane: --address = '{silent_peer.address}': no Ray cluster answers there within 3 s "
            "(something listens on that port, but not Ray's GCS); check the address (`raylane up` prints "
            "it) or leave --address out for a local cluster"
        )
    ], cli.output
    # 3 s of waiting plus start-up; before, it waited for good. A loose bound: the machine may be busy.
    assert took < 60, f"gave up after {took:.0f} s"
    # The run (or the sweep's or search's parent) opened beside the wait.
    assert _statuses(uri) == ["FAILED"], cli.output


def test_sigterm_while_waiting_for_the_cluster_stops_at_once_and_closes_the_run(run_cli, tmp_path, silent_peer):
    env, uri = _tracked(tmp_path)
    cli = run_cli("train", "digits", "--address", silent_peer.address, env=env)
    # The first connection is the command's own check that something listens; then Ray's.
    wait_for(lambda: len(silent_peer.accepted) >= 2 or cli.proc.poll() is not None, 60)
    assert cli.proc.poll() is None, cli.output
    cli.signal(signal.SIGTERM)
    code = cli.wait(60)
    assert code == 130, cli.output
    assert "raylane: interrupted while waiting for the Ray cluster; nothing was trained" in cli.output
    assert "Traceback" not in cli.output  # exit 130 and that line: the signal's doing, not the 10 s limit's
    assert _statuses(uri) == ["KILLED"]


def test_sigterm_while_joining_closes_a_run_whose_opener_lost_an_import_race(run_cli, tmp_path, silent_peer):
    """The MLflow run is opened on a thread while the main thread imports Ray and joins: two
    threads importing shared dependencies at once can leave one with a half-imported module
    (Python breaks an import deadlock that way). The opener's import fails once, here on purpose
    (tests/helpers/delays), as it did in about one full run in twelve: the command's line and exit
    were right, but no MLflow run existed at all. The opener now opens it once more."""
    env, uri = _tracked(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests/helpers/delays"), env.get("PYTHONPATH")]))
    env["RAYLANE_TEST_DELAYS"] = "raise:mlflow.tracking@thread=raylane-start"
    cli = run_cli("train", "digits", "--address", silent_peer.address, env=env)
    wait_for(lambda: len(silent_peer.accepted) >= 2 or cli.proc.poll() is not None, 60)
    assert cli.proc.poll() is None, cli.output
    cli.signal(signal.SIGTERM)
    assert cli.wait(60) == 130, cli.output
    assert _statuses(uri) == ["KILLED"]


@pytest.mark.ray
@pytest.mark.shared_ray
def test_sigterm_to_a_sweep_on_a_joined_cluster_closes_its_parent_run(run_cli, tmp_path):
    """A joined cluster gets no SIGTERM handler of Ray's (ray.init runs on a thread of its own):
    the sweep's own handler turns the signal into an interrupt that closes the parent run KILLED
    and gives the sweep's lease back, rather than the process ending on the spot."""
    env, uri = _tracked(tmp_path)
    sweep = run_cli("tune", "digits-sweep", "--set", "sweep.num_samples=1", "--set", "train.max_epochs=1000", env=env)
    wait_for(lambda: "[raylane] sweep digits-asha" in sweep.output or sweep.proc.poll() is not None, 240)
    assert sweep.proc.poll() is None, sweep.output
    sweep.signal(signal.SIGTERM)
    assert sweep.wait(120) == 130, sweep.output
    assert "raylane: interrupted" in sweep.output and "Traceback" not in sweep.output
    assert _statuses(uri)[0] == "KILLED"  # the parent (trials, if any started, come after it)
    assert not (tmp_path / "runs" / "digits-asha" / "raylane_lease.json").exists()


# tune and autotune: make test-all (the same join and the same session as train).
@pytest.mark.parametrize(
    "name",
    ["train", pytest.param("tune", marks=pytest.mark.slow), pytest.param("autotune", marks=pytest.mark.slow)],
)
def test_ctrl_c_while_ray_starts_ends_the_command_killed_with_one_line(name, run_cli, tmp_path):
    """The one lifecycle (raylane.session), from outside: Ctrl-C while each command waits for Ray
    (joining a cluster that does not answer yet) ends it with exit 130 and one line of raylane's,
    no traceback, its summary (where it writes one) and its MLflow run (the sweep's and the
    search's parent run) KILLED. The same, in-process: tests/unit/test_session.py."""
    command = {"train": ["train", "digits"], "tune": ["tune", "digits-sweep"], "autotune": ["autotune", "digits"]}[name]
    env, uri = _tracked(tmp_path)
    env["RAYLANE_JOIN_TIMEOUT_S"] = "120"  # the interrupt, not the join's limit, ends the wait
    peer = SilentPeer()
    try:
        cli = run_cli(*command, "--address", peer.address, "--summary-json", "a.json", env=env, cwd=tmp_path)
        # The first connection is the command's own check that something listens; the second, its
        # wait for the GCS to speak gRPC (raylane.onray.cluster), where the interrupt lands.
        wait_for(lambda: len(peer.accepted) >= 2 or cli.proc.poll() is not None, 120)
        assert cli.proc.poll() is None, cli.output
        cli.signal(signal.SIGINT)
        code = cli.wait(60)
    finally:
        peer.close()
    mine = [line for line in cli.output.splitlines() if line.startswith("raylane")]
    assert code == 130, (name, cli.output)
    assert len(mine) == 1 and "interrupted" in mine[0], (name, cli.output)
    assert "Traceback" not in cli.output, (name, cli.output)
    if (tmp_path / "a.json").exists():
        assert read_json(tmp_path / "a.json")["status"] == "KILLED", name
    assert _statuses(uri) == ["KILLED"], name
