"""scripts/slurm-ray.sbatch on a real Slurm: a one-node cluster of the test's own (Debian's
slurm-wlm: munged, slurmctld, slurmd, started and stopped by the test, tests/helpers/slurm.py).
In make test: a bad config, and a GCS port in Ray's worker range, fail the job in one line before
Ray starts; and the script's node and wait, without Slurm, on a head made slow to start on purpose
(15 s more than its own start, past the 10 s join that used to end the wait): the wait sees it up,
then fails in one line naming, by its Slurm name, a node that did not join. The slow tests run the
script to a FINISHED run recorded on a real MLflow server on a head 60 s slow to start, a job
whose head never starts failing within RAYLANE_NODES_TIMEOUT_S naming the node, a `scancel`
mid-training that leaves a committed checkpoint a relaunch resumes, and the time limit's notice to
the script alone stopping the run the same way.

What one node cannot show: worker nodes joining from other hosts through srun (the head's srun
task is the only one here), a wait that succeeds with more than one node, the ranks' traffic
between nodes, and storage shared between hosts."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raylane.loop import checkpoint
from tests.conftest import REPO, free_port, read_json, wait_for
from tests.helpers import slurm as slurm_helper

SCRIPT = str(REPO / "scripts" / "slurm-ray.sbatch")
QUICK = ["--set", "mlflow.log_model=false", "--set", "mlflow.system_metrics=false"]
BIN = Path(sys.executable).parent


@pytest.fixture
def slurm():
    why = slurm_helper.missing()
    if why:
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="rl-slurm-", dir="/tmp"))  # short: munge's socket path is limited
    cluster = slurm_helper.SlurmCluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _token(tmp_path: Path) -> Path:
    token = tmp_path / "auth_token"
    if not token.exists():
        token.write_text(uuid.uuid4().hex)
        token.chmod(0o600)
    return token


def _job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """What sbatch exports to the job: this interpreter's bin first (the script's python3 and
    raylane), a token of the test's own, a GCS port of its own, storage in tmp_path."""
    token = _token(tmp_path)
    env = {
        "PATH": f"{BIN}:{os.environ['PATH']}",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAYLANE_RAY_PORT": str(free_port()),
        "RAYLANE_STORAGE": str(tmp_path / "runs"),
        "RAYLANE_HOME": str(tmp_path / "raylane-home"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }
    return env


def _submit(slurm, tmp_path: Path, name: str, *args: str, env: dict[str, str]) -> tuple[int, Path]:
    out = tmp_path / f"{name}.out"
    job = slurm.sbatch("--nodes=1", f"--output={out}", f"--job-name={name}", SCRIPT, *args, cwd=tmp_path, env=env)
    return job, out


def test_bad_input_fails_the_job_in_one_line_before_ray(slurm, tmp_path):
    """The shipped script under sbatch: its settings, the config and its --set keys are checked
    first, so a typo, or a GCS port in Ray's worker range (where Ray failed with a traceback),
    ends the job with raylane's exit 2 and its one line, and no node started Ray."""
    job, out = _submit(slurm, tmp_path, "bad", "digits", "--set", "train.max_epochs=-1", env=_job_env(tmp_path))
    state = slurm.wait_job(job, 120)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "2:0"), (state, out.read_text())
    assert out.read_text() == (
        "raylane: invalid config: train.max_epochs = -1: Input should be greater than or equal to 1\n"
    )
    job, out = _submit(slurm, tmp_path, "port", "digits", env=_job_env(tmp_path, RAYLANE_RAY_PORT="16379"))
    state = slurm.wait_job(job, 120)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "2:0"), (state, out.read_text())
    assert out.read_text() == (
        "raylane slurm: RAYLANE_RAY_PORT = 16379: inside Ray's worker port range 10002-19999, where each "
        "node's workers take their ports; choose one outside it (6379 by default)\n"
    )


HEAD_DELAY_S = 15  # beyond the 10 s join the wait used to give a head whose GCS answered


@pytest.mark.slow  # ~40 s: a head 15 s late, then a 10 s wait for a node that never comes; make test runs a job under Slurm to its one-line refusal (above) and the node's lifetime in-process (tests/unit/test_slurm_node.py)
@pytest.mark.ray
def test_a_head_slow_to_start_is_waited_for_and_a_node_that_never_joins_is_named(tmp_path):
    """The script's node and wait, as srun and the script run them, without Slurm: a head whose
    node registers HEAD_DELAY_S late (its GCS answering meanwhile, as on a loaded node) is waited
    for within the wait's one bound; a wait for a second node, which never comes, fails in one
    line naming it, the head named by the Slurm name its Ray carries (not this host's name)."""
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(_token(tmp_path)),
        "SLURMD_NODENAME": "node-a",
        **slurm_helper.slow_head(tmp_path / "slow", HEAD_DELAY_S),
    }
    address = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "node.log", "w") as log:
        node = subprocess.Popen(
            [sys.executable, "-m", "raylane.onray.slurm", "node", "--head", "--ip", "127.0.0.1"]
            + ["--port", address.rsplit(":", 1)[1]],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        start = time.monotonic()
        up = _wait(address, 1, 300, ["node-a"], env)
        assert up.returncode == 0 and up.stdout.startswith(f"raylane slurm: 1 Ray node(s) up at {address} after"), (
            up.stderr + (tmp_path / "node.log").read_text()
        )
        assert time.monotonic() - start > HEAD_DELAY_S  # it did wait for the head's late node
        assert socket.gethostname().split(".")[0] != "node-a"
        missing = _wait(address, 2, 10, ["node-a", "node-b"], env)
        assert missing.returncode == 1 and missing.stderr == (
            f"raylane slurm: 1 of 2 Ray nodes up, the head on node-a ({address}), within 10 s "
            "(RAYLANE_NODES_TIMEOUT_S); not joined: node-b\n"
        )
    finally:
        os.kill(node.pid, signal.SIGUSR1)  # the script's stop
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
        assert not slurm_helper.session_alive(node.pid)


def _wait(address: str, nodes: int, timeout_s: float, hosts: list[str], env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raylane.onray.slurm", "wait", "--address", address, "--nodes", str(nodes)]
        + ["--timeout", str(timeout_s), "--hosts", *hosts],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s + 120,
    )


@pytest.mark.slow  # a Ray head under Slurm that never starts (~1.5 min on 2 cores)
@pytest.mark.ray
def test_a_head_that_never_starts_fails_the_job_within_the_bound_naming_its_node(slurm, tmp_path):
    env = _job_env(tmp_path, RAYLANE_NODES_TIMEOUT_S="20", **slurm_helper.slow_head(tmp_path / "slow", 3600))
    job, out = _submit(slurm, tmp_path, "never", "digits", env=env)
    state = slurm.wait_job(job, 300)
    log = out.read_text()
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "1:0"), (state, log)
    port = env["RAYLANE_RAY_PORT"]
    lines = [ln for ln in log.splitlines() if ln.startswith("raylane slurm:") and "stopping" not in ln]
    assert len(lines) == 1 and lines[0].startswith("raylane slurm: 0 of 1 Ray nodes up, the head on "), log
    assert lines[0].endswith(f":{port}), within 20 s (RAYLANE_NODES_TIMEOUT_S); not joined: {slurm.host}"), log
    # The bound, and the checks and the stop around it: not the 300 s default, nor a hang.
    assert _seconds(state["RunTime"]) < 20 + 120, state
    wait_for(lambda: not slurm.job_processes(), timeout_s=30)


def _seconds(run_time: str) -> int:
    """Slurm's RunTime ([D-]HH:MM:SS) in seconds."""
    days, _, clock = run_time.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def _committed(runs: Path, name: str, step: int) -> bool:
    return any(
        int(m.parent.name.rsplit("_", 1)[-1]) >= step
        for m in (runs / name).glob(f"checkpoint_*/{checkpoint.MANIFEST_FILE}")
    )


@pytest.mark.slow  # a Ray cluster under Slurm whose head starts a minute late, one run (~3 min on 2 cores)
@pytest.mark.ray
def test_sbatch_runs_to_finished_on_mlflow_and_the_cluster_ends_with_the_job(slurm, mlflow_server, tmp_path):
    """On a head that takes 60 s longer to start (the field report's node took 25 s, and the wait
    gave up after 10): the wait sees it up within RAYLANE_NODES_TIMEOUT_S, and the run FINISHES."""
    env = _job_env(tmp_path, MLFLOW_TRACKING_URI=mlflow_server.uri, **slurm_helper.slow_head(tmp_path / "slow", 60))
    args = [
        "digits",
        "--set",
        "run.name=sb",
        "--set",
        "train.max_epochs=1",
        *QUICK,
        "--summary-json",
        str(tmp_path / "s.json"),
    ]
    job, out = _submit(slurm, tmp_path, "train", *args, env=env)
    state = slurm.wait_job(job, 400)
    log = out.read_text()
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), (state, log)
    assert "raylane slurm: 1 Ray node(s) up at " in log
    assert float(log.split("raylane slurm: 1 Ray node(s) up at ", 1)[1].split(" after ")[1].split(" s")[0]) > 60
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["world_size"] == 2, s
    run = MlflowClient(mlflow_server.uri).get_run(s["run_id"])
    assert run.info.status == "FINISHED" and "train/loss" in run.data.metrics, run.data.metrics
    assert run.data.params["train.max_epochs"] == "1"
    # Ray's processes went with the job: nothing that Slurm or the script started is left.
    wait_for(lambda: not slurm.job_processes(), timeout_s=30)


@pytest.mark.slow  # two jobs on a Ray cluster under Slurm (~3 min on 2 cores)
@pytest.mark.ray
def test_scancel_leaves_a_committed_checkpoint_and_a_relaunch_resumes_it(slurm, mlflow_server, tmp_path):
    env = _job_env(tmp_path, MLFLOW_TRACKING_URI=mlflow_server.uri)
    long = ["--set", "train.max_epochs=400", "--set", "checkpoint.every_n_steps=20"]
    first_args = ["digits", "--set", "run.name=sc", *long, *QUICK, "--summary-json", str(tmp_path / "first.json")]
    job, out = _submit(slurm, tmp_path, "first", *first_args, env=env)
    wait_for(lambda: _committed(tmp_path / "runs", "sc", 20), timeout_s=400)
    assert slurm.run("scancel", str(job)).returncode == 0
    state = slurm.wait_job(job, 120)
    assert state["JobState"] == "CANCELLED", (state, out.read_text())
    s = read_json(tmp_path / "first.json")
    assert s["status"] == "KILLED" and s["preempted"] is True, (s, out.read_text())
    assert s["checkpoint"].endswith(checkpoint.checkpoint_name(s["steps"]))
    assert checkpoint.verify(s["checkpoint"]) is None  # committed, every shard intact
    assert MlflowClient(mlflow_server.uri).get_run(s["run_id"]).info.status == "KILLED"
    wait_for(lambda: not slurm.job_processes(), timeout_s=30)

    again_args = ["digits", "--set", "run.name=sc", "--set", f"train.max_steps={s['steps'] + 5}"]
    again_args += ["--set", "checkpoint.every_n_steps=20", *QUICK, "--summary-json", str(tmp_path / "again.json")]
    job, out = _submit(slurm, tmp_path, "again", *again_args, env=env)
    state = slurm.wait_job(job, 400)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), (state, out.read_text())
    again = read_json(tmp_path / "again.json")
    assert again["resumed_from_step"] == s["steps"]  # no step lost
    assert again["run_id"] == s["run_id"] and again["status"] == "FINISHED"
    assert MlflowClient(mlflow_server.uri).get_run(s["run_id"]).info.status == "FINISHED"


@pytest.mark.slow  # a Ray cluster under Slurm and a run stopped mid-way (~1.5 min on 2 cores)
@pytest.mark.ray
def test_the_time_limits_notice_to_the_script_alone_stops_the_run_at_a_checkpoint(slurm, mlflow_server, tmp_path):
    """`#SBATCH --signal=B:TERM@120` sends SIGTERM to the batch script alone, as `scancel --batch
    --signal=TERM` does: the script passes it to the driver, the ranks checkpoint at one agreed
    step, the job ends with the driver's 130, and the script stops the nodes."""
    env = _job_env(tmp_path, MLFLOW_TRACKING_URI=mlflow_server.uri)
    args = ["digits", "--set", "run.name=tl", "--set", "train.max_epochs=400", "--set", "checkpoint.every_n_steps=20"]
    job, out = _submit(slurm, tmp_path, "notice", *args, *QUICK, "--summary-json", str(tmp_path / "s.json"), env=env)
    wait_for(lambda: _committed(tmp_path / "runs", "tl", 20), timeout_s=400)
    assert slurm.run("scancel", "--batch", "--signal=TERM", str(job)).returncode == 0
    state = slurm.wait_job(job, 120)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "130:0"), (state, out.read_text())
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "KILLED" and s["preempted"] is True, s
    assert checkpoint.verify(s["checkpoint"]) is None and s["checkpoint"].endswith(
        checkpoint.checkpoint_name(s["steps"])
    )
    assert "raylane slurm: stopping the Ray node on " in out.read_text()
    wait_for(lambda: not slurm.job_processes(), timeout_s=30)
