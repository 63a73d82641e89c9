"""One run, one writer, from two terminals: a second launch of a running run.name exits 2 naming
the holder (the lease itself: tests/unit/test_lease.py)."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from raylane import lease
from tests.conftest import cli_env, wait_for


@pytest.mark.untracked
def test_the_second_of_two_launches_of_one_run_name_exits_2(run_cli, tmp_path):
    """Two terminals, one run.name. Before, the second printed 'continued' and both trained into
    the same checkpoint folder and MLflow run."""
    args = ["train", "digits", "--local", "--set", "run.name=twice"]
    # It trains until killed: 20 ms asleep in each step leave the CPU to the tests beside it.
    first = run_cli(
        *args, "--set", "train.max_epochs=200", env=cli_env(tmp_path, RAYLANE_FAULTS="slow@rank=0,ms=20"), name="first"
    )
    wait_for(lambda: (tmp_path / "runs" / "twice" / lease.LEASE_FILE).exists() or first.proc.poll() is not None, 120)
    assert first.proc.poll() is None, first.output
    second = run_cli(*args, name="second")
    assert second.wait(60) == 2, second.output
    line = (
        f"raylane: run.name = 'twice': run 'twice' is already running (pid {first.proc.pid} on {socket.gethostname()}"
    )
    assert second.output.startswith(line) and len(second.output.strip().splitlines()) == 1, second.output
    # The holder crashes (no way out runs): its lease stays, naming a process that is gone.
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait(30)
    third = run_cli(*args, "--set", "train.max_epochs=1", "--set", "mlflow.enabled=false", name="third")
    assert third.wait(180) == 0, third.output
    assert f"run 'twice': took over the lease of pid {first.proc.pid} on {socket.gethostname()}" in third.output
    assert not (tmp_path / "runs" / "twice" / lease.LEASE_FILE).exists()  # given back at the end
