"""scripts/slurm-ray.sbatch on a real Slurm: a one-node cluster of the test's own (Debian's
slurm-wlm: munged, slurmctld, slurmd, started and stopped by the test, tests/helpers/slurm.py).
In make test: a bad config fails the job in one line before Ray starts, and the script's wait for
the nodes, asked of a real Ray head (the session's shared one), fails in one line naming the node
that did not join. The slow tests run the script to a FINISHED run recorded on a real MLflow
server, a `scancel` mid-training that leaves a committed checkpoint a relaunch resumes, and the
time limit's notice to the script alone stopping the run the same way.

What one node cannot show: worker nodes joining from other hosts through srun (the head's srun
task is the only one here), a wait that succeeds with more than one node, the ranks' traffic
between nodes, and storage shared between hosts."""

from __future__ import annotations

import os
import shutil
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


def _job_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """What sbatch exports to the job: this interpreter's bin first (the script's python3 and
    raylane), a token of the test's own, a GCS port of its own, storage in tmp_path."""
    token = tmp_path / "auth_token"
    if not token.exists():
        token.write_text(uuid.uuid4().hex)
        token.chmod(0o600)
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


def test_a_bad_config_fails_the_job_in_one_line_before_ray(slurm, tmp_path):
    """The shipped script under sbatch: the config and its --set keys are checked first, so a
    typo ends the job with raylane's exit 2 and its one line, and no node started Ray."""
    job, out = _submit(slurm, tmp_path, "bad", "digits", "--set", "train.max_epochs=-1", env=_job_env(tmp_path))
    state = slurm.wait_job(job, 60)
    assert (state["JobState"], state["ExitCode"]) == ("FAILED", "2:0"), (state, out.read_text())
    assert out.read_text() == (
        "raylane: invalid config: train.max_epochs = -1: Input should be greater than or equal to 1\n"
    )


@pytest.mark.ray
@pytest.mark.shared_ray
def test_the_wait_for_the_nodes_asks_ray_and_fails_in_one_line(shared_head, tmp_path):
    """The script's wait against a real head (the session's shared one: one node), for the two
    nodes an allocation of two would need: it sees the one that joined, names the other, and
    fails in one line within its bound."""
    env = {**os.environ, **shared_head.start()}
    address = shared_head.cluster()["address"]
    here = os.uname().nodename.split(".")[0]
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "raylane.onray.slurm", "wait", "--address", address, "--nodes", "2"]
        + ["--timeout", "1", "--hosts", here, "node-b"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert (
        out.stderr == f"raylane slurm: 1 of 2 Ray nodes joined the head at {address} within 1 s (not joined: node-b)\n"
    )
    # Python, Ray's import and ray.init, then one look: seconds, not the minutes an unbounded wait
    # would take (loose: the machine may be busy).
    assert time.monotonic() - start < 50


def _committed(runs: Path, name: str, step: int) -> bool:
    return any(
        int(m.parent.name.rsplit("_", 1)[-1]) >= step
        for m in (runs / name).glob(f"checkpoint_*/{checkpoint.MANIFEST_FILE}")
    )


@pytest.mark.slow  # a Ray cluster under Slurm, two jobs (~2 min on 2 cores)
@pytest.mark.ray
def test_sbatch_runs_to_finished_on_mlflow_and_the_cluster_ends_with_the_job(slurm, mlflow_server, tmp_path):
    env = _job_env(tmp_path, MLFLOW_TRACKING_URI=mlflow_server.uri)
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
