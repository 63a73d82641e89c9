"""Ray heads and their MLflow runs: every process a test starts is killed by the test, by session.
The job checks run on the session's shared `raylane up` head (token authentication on): the jobs
API refuses without the token; `ray job submit` of a user's own project (examples/own-model, copied
away from the checkout, as its working dir); `raylane submit --follow` of a shipped pipeline from
the checkout. The autoscaler test starts a `ray start --head` of its own (Ray's fake multi-node
provider), which adds nodes for a 2-worker run and removes them after."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO, descendants, free_port, read_json, session_processes, wait_for

pytestmark = pytest.mark.ray
BIN = Path(sys.executable).parent


def _answers(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def _auth_env(tmp_path: Path) -> dict[str, str]:
    """The environment of every process that talks to the test's head: token mode, and a token of
    the test's own (a fresh machine has no ~/.ray/auth_token, and the user's is left alone)."""
    token = tmp_path / "auth_token"
    if not token.exists():
        token.write_text(uuid.uuid4().hex)
        token.chmod(0o600)
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token), PATH=f"{BIN}:{os.environ['PATH']}")
    env.pop("RAY_ADDRESS", None)
    return env


def ray_job_submit(args: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`ray job submit ARGS`, again while a head that has just started answers "No available agent
    to submit job, please try again later" (its job agent registers after the dashboard is up)."""
    deadline = time.monotonic() + 120
    while True:
        out = subprocess.run(
            [str(BIN / "ray"), "job", "submit", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if out.returncode == 0 or "No available agent" not in out.stderr or time.monotonic() > deadline:
            return out
        time.sleep(2)


@contextlib.contextmanager
def _head(tmp_path: Path, *extra: str, env: dict[str, str] | None = None, gcs_port: int | None = None):
    """`ray start --head --block` on 127.0.0.1 with its own temp dir and ports, token auth on.
    Yields (dashboard URL, GCS address, temp dir); kills its whole session by pid at the end."""
    gcs_port, dashboard_port = gcs_port or free_port(), free_port()
    temp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # short: Ray's unix socket paths are limited
    env = {**_auth_env(tmp_path), "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    log = open(tmp_path / "head.log", "w")
    proc = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--temp-dir={temp}",
            "--include-dashboard=true",
            *extra,
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 120
        while _answers(f"{url}/api/version") is None:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()
            time.sleep(0.5)
        yield url, f"127.0.0.1:{gcs_port}", Path(temp)
    finally:
        # The session holds every process of the cluster, the autoscaler's fake nodes included.
        for pid in {proc.pid, *session_processes(proc.pid), *descendants(proc.pid)}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _mlflow_run(db: Path, run_id: str) -> tuple[str, dict[str, str]]:
    with sqlite3.connect(db) as con:
        status = con.execute("SELECT status FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()[0]
        tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)).fetchall())
    return status, tags


# The smallest run that proves it: one epoch, no model logged, no system metrics.
QUICK = ["--set", "train.max_epochs=1", "--set", "mlflow.log_model=false", "--set", "mlflow.system_metrics=false"]
EXAMPLE = REPO / "examples" / "own-model"


@pytest.mark.shared_ray
def test_ray_job_submit_and_raylane_submit_on_a_token_authenticated_head(tmp_path, shared_head):
    """The session's shared head (`raylane up`: token auth on, the jobs API on its dashboard) for
    every job check: the jobs API refuses without the token; a user's own project as a `ray job
    submit` job, the project as its working dir and its results where the README says to send
    them; a project's config through `raylane submit --follow` with nothing set, whose MLflow run
    and checkpoints land in the project's mlflow.db and runs/, not in the job's temporary copy of
    the project. (Joining a head with `raylane train --address`: test_own_pipeline.)"""
    # A copy of the example project, away from raylane's checkout (it has app/ and pipelines/ of its own).
    project = Path(shutil.copytree(EXAMPLE, tmp_path / "own-model", ignore=shutil.ignore_patterns("__pycache__")))
    db = tmp_path / "mlflow.db"
    storage = ["--set", f"run.storage_path={tmp_path / 'runs'}"]
    head = shared_head.start()
    url = shared_head.cluster()["dashboard_url"]
    # Without the token the jobs API refuses, and `raylane submit` says so in one line.
    assert _answers(f"{url}/api/jobs/") == 401
    env = dict(_auth_env(tmp_path), **head, RAY_ADDRESS=url)
    (tmp_path / "wrong_token").write_text("0" * 32)
    refused = subprocess.run(
        [str(BIN / "raylane"), "submit", "digits", "--address", url],
        check=False,
        cwd=tmp_path,
        env=dict(env, RAY_AUTH_TOKEN_PATH=str(tmp_path / "wrong_token")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout + refused.stderr
    assert refused.stderr.splitlines() == [
        (
            f"raylane: --address = '{url}': the cluster refused this token (HTTP "
            "403); set RAY_AUTH_TOKEN_PATH to a file holding the cluster's token"
        )
    ]

    # `ray job submit` of the user's own project, with the project as the job's working dir.
    runtime_env = {"env_vars": {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}}
    # Both jobs run side by side (the head has room for both), each mostly waiting on start-up.
    pool = ThreadPoolExecutor(1)
    own_job = pool.submit(
        ray_job_submit,
        [
            "--working-dir",
            str(project),
            "--runtime-env-json",
            json.dumps(runtime_env),
            "--",
            "raylane",
            "train",
            "train.yaml",
            *QUICK,
            *storage,
            # One training worker for each job: checked here is the way in, and where the records land.
            "--set",
            "scaling.num_workers=1",
        ],
        cwd=tmp_path,
        env=env,
        timeout=300,
    )

    # `raylane submit --follow` from a project of its own (a config file, the job's working dir),
    # with MLflow's default store and the default run.storage_path: both relative.
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "job.yaml").write_text(
        "pipeline: digits\nscaling: {num_workers: 1}\ntrain: {max_epochs: 1}\n"
        "mlflow: {log_model: false, system_metrics: false}\n"
    )
    env_here = {k: v for k, v in env.items() if k != "MLFLOW_TRACKING_URI"}
    follow = subprocess.Popen(
        [str(BIN / "raylane"), "submit", "job.yaml", "--address", url, "--follow", "--summary-json", "job.json"],
        cwd=mine,
        env=env_here,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = follow.communicate(timeout=400)
    finally:
        follow.kill()
        pool.shutdown()
    out = own_job.result()
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    job_id = re.search(r"Job '(raysubmit_\w+)' submitted successfully", out.stdout + out.stderr).group(1)
    run_id = re.findall(r"MLflow run id:\s+([0-9a-f]{32})", out.stdout)[-1]
    status, tags = _mlflow_run(db, run_id)
    assert status == "FINISHED"
    assert tags["raylane.ray_job_id"] == job_id  # the run knows which job it came from

    assert follow.returncode == 0, stdout[-4000:] + stderr[-4000:]
    # submit says where the results will be, before the job's own lines
    assert (
        f"MLflow sqlite:///{mine / 'mlflow.db'}, experiment raylane; checkpoints under {mine / 'runs'}/ "
        "(in a folder named for the run)" in stdout.splitlines()[1]
    ), stdout
    job_id, status, run_id = re.search(r"job (raysubmit_\w+): (\w+) \(MLflow run ([0-9a-f]{32})\)", stdout).groups()
    assert status == "SUCCEEDED"
    job = read_json(mine / "job.json")  # the job's end, as the schema documents it
    assert (job["command"], job["status"], job["job_status"], job["job_id"], job["run_id"]) == (
        "submit",
        "FINISHED",
        "SUCCEEDED",
        job_id,
        run_id,
    )
    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{mine / 'mlflow.db'}").get_run(run_id)  # the submitter's own store
    assert run.info.status == "FINISHED" and run.data.tags["raylane.ray_job_id"] == job_id
    checkpoints = sorted((mine / "runs" / run.data.tags["raylane.run_name"]).glob("checkpoint_*"))
    assert checkpoints and (checkpoints[-1] / "manifest.json").is_file()


# Ray's fake multi-node provider: the autoscaler starts each "node" as its own raylet on this
# machine. The head has no CPUs, so every training worker needs a node the autoscaler adds.
FAKE_CLUSTER = {
    "cluster_name": "raylane-fake",
    "max_workers": 3,
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 0.2,
    "provider": {
        "type": "fake_multinode",
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
        "launch_multiple": True,
    },
    "auth": {"ssh_user": "ubuntu"},
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
        "cpu_node": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 3},
    },
    "head_node_type": "ray.head.default",
    **{
        k: []
        for k in (
            "cluster_synced_files",
            "initialization_commands",
            "setup_commands",
            "head_setup_commands",
            "worker_setup_commands",
            "head_start_ray_commands",
            "worker_start_ray_commands",
        )
    },
    "file_mounts": {},
    "file_mounts_sync_continuously": False,
}
# Every raylet here shares one host: without this, Ray resolves 127.0.0.1 to the host's network
# address, where nothing listens, in the fake nodes and in the driver alike.
ONE_HOST = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _worker_nodes(gcs: str, env: dict[str, str]) -> int | None:
    """Active worker nodes as the autoscaler reports them; None before its first report."""
    out = subprocess.run(
        [str(BIN / "ray"), "status", "--address", gcs], env=env, capture_output=True, text=True, timeout=60
    ).stdout
    if "Active:" not in out:
        return None
    active = out.split("Active:", 1)[1].split("Pending:", 1)[0]
    return sum(int(n) for n, kind in re.findall(r"(\d+) (\S+)", active) if kind == "cpu_node")


@pytest.mark.slow  # ~45 s soak; cluster.yaml's checks stay in make test (test_cluster_config)
def test_autoscaler_adds_nodes_for_a_two_worker_run_and_removes_them_after(tmp_path):
    import yaml

    gcs_port = free_port()
    config = {**FAKE_CLUSTER, "provider": {**FAKE_CLUSTER["provider"], "gcs_address": f"127.0.0.1:{gcs_port}"}}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(config))
    head_env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", **ONE_HOST}
    with _head(
        tmp_path, "--num-cpus=0", f"--autoscaling-config={tmp_path / 'cluster.yaml'}", env=head_env, gcs_port=gcs_port
    ) as (_, gcs, temp):
        env = dict(_auth_env(tmp_path), **ONE_HOST)
        assert wait_for(lambda: _worker_nodes(gcs, env) is not None, 60)
        assert _worker_nodes(gcs, env) == 0

        out = subprocess.run(
            [
                str(BIN / "raylane"),
                "train",
                "pipelines/digits.yaml",
                "--address",
                gcs,
                "--set",
                "scaling.num_workers=2",
                "--set",
                "train.max_epochs=2",
                "--set",
                "strategy.name=fsdp",
                "--set",
                "mlflow.enabled=false",
                "--set",
                f"run.storage_path={tmp_path / 'runs'}",
                "--summary-json",
                str(tmp_path / "summary.json"),
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        summary = read_json(tmp_path / "summary.json")
        assert summary["status"] == "FINISHED" and summary["metrics"]["accuracy"] > 0.8
        # One worker on each added node. Ray Train, which numbers nodes by IP address, calls them
        # both node 0 here; raylane numbers them by Ray node id, and shards HSDP within a node.
        assert summary["node_ranks"] == [0, 1]
        assert summary["strategy"] == "hsdp" and summary["mesh"] == [2, 1]
        assert "on 2 workers across 2 nodes" in out.stdout

        monitor = next(temp.glob("session_*/logs/monitor.log"))
        # The autoscaler may add the two nodes in one go or one at a time.
        added = re.findall(r"Adding (\d+) node\(s\) of type cpu_node", monitor.read_text())
        assert sum(map(int, added)) >= 2, added
        # Idle for 12 s (idle_timeout_minutes), the nodes go away.
        deadline = time.monotonic() + 180
        while _worker_nodes(gcs, env) != 0:
            assert time.monotonic() < deadline, "the idle nodes were not removed"
            time.sleep(2)
        # No log line is asserted for the removal: the monitor writes "Removing N
        # nodes (idle)" in some rounds and only "Resized to 0 CPUs" in others.


def _newest_raylet(temp: Path) -> int:
    """The raylet the autoscaler started last in the cluster whose temp dir is `temp`: a node the
    run grew onto. (Every fake node has 127.0.0.1 for its address, so the driver attaches to any
    raylet there: the one that was up at launch, not this one.)"""
    import psutil

    raylets = [
        p
        for p in psutil.process_iter(["name", "cmdline", "create_time"])
        if p.info["name"] == "raylet" and str(temp) in " ".join(p.info["cmdline"] or [])
    ]
    return max(raylets, key=lambda p: p.info["create_time"]).pid


# A map-style pipeline that writes down, for each training micro-batch, the process, the time and
# the sample indices (its input is the index): on Ray, workers see the config, not the driver's
# environment, so the file's place is a config key.
RECORDING_PIPELINE = """
import json, os, time
import torch
import raylane


class Model(raylane.Section):
    record: str = "seen"
    pace: str = ""  # while this file exists, each training micro-batch takes at least 20 ms


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self):
        return ("loss",)


class Recording(torch.nn.Module):
    def __init__(self, record, pace):
        super().__init__()
        self.record, self.pace = record, pace
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x):
        if self.training:
            with open(f"{self.record}.{os.environ.get('RANK', '0')}", "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "t": time.time(), "i": [int(v) for v in x[:, 0].tolist()]}) + "\\n")
            if self.pace and os.path.exists(self.pace):
                time.sleep(0.02)
        return self.linear(x / 40)


def build(cfg):
    from torch.utils.data import TensorDataset
    from raylane.loop.protocols.pipeline import Pipeline

    x = torch.arange(40, dtype=torch.float32)[:, None]
    return Pipeline(model=Recording(cfg.model.record, cfg.model.pace), train_set=TensorDataset(x, x / 80),
                    eval_set=TensorDataset(x[:8], x[:8] / 80), loss_fn=torch.nn.functional.mse_loss,
                    eval_sums=lambda o, t: {"loss": torch.nn.functional.mse_loss(o, t, reduction="sum")})
"""
# 3,000 steps: 40 ms each on one worker while the test waits for the resizes (a node is added in
# ~25 s here: room for a machine four times as slow), ~4 ms each once they are done (model.pace).
ELASTIC_EPOCHS = 600


def _recorded_steps(
    record: Path, resumed: list[int], *, held: int, micro: int, trained: dict[int, int] | None = None
) -> dict[int, list[int]]:
    """step -> its samples over all ranks, the last group's where a step was redone. A group is
    the processes of one start of the worker group: rank 0's process tells them apart, and
    another rank's process belongs to the group that rank 0 started last by (at most 2 s after:
    restarts are seconds apart). Group g resumed from `resumed[g - 1]` (0 for the first).
    `trained`, when given, gets the number of steps each group trained."""
    blocks: dict[tuple[int, int], list[dict]] = {}  # (rank, pid) -> its lines, in order
    for path in record.parent.glob(record.name + ".*"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            blocks.setdefault((int(path.suffix[1:]), entry["pid"]), []).append(entry)
    starts = sorted(lines[0]["t"] for (rank, _), lines in blocks.items() if rank == 0)
    assert len(starts) == len(resumed) + 1, (starts, resumed)
    groups: dict[int, list[list[dict]]] = defaultdict(list)
    for lines in blocks.values():
        groups[max(g for g, t in enumerate(starts) if t - 2.0 <= lines[0]["t"])].append(lines)
    steps: dict[int, list[int]] = {}
    for g, members in sorted(groups.items()):
        accum = held // (micro * len(members))
        first = resumed[g - 1] if g else 0
        group: dict[int, list[int]] = defaultdict(list)
        for lines in members:
            for n, entry in enumerate(lines):
                group[first + 1 + n // accum].extend(entry["i"])
        steps.update(group)  # a step redone after a loss: the group that went on from it counts
        if trained is not None:
            trained[g] = len(group)
    return steps


def _train_workers(raylet: int) -> list[int]:
    """The Ray Train worker processes under a raylet (the processes it started)."""
    import psutil

    return [p.pid for p in psutil.Process(raylet).children(recursive=True) if "TrainWorker" in " ".join(p.cmdline())]


@pytest.mark.parametrize(
    "notice",
    [
        # a spot reclaim: SIGTERM to the node's worker, then the node goes (~80 s: make test resizes
        # elastic runs under torchrun in test_elastic)
        pytest.param("sigterm", marks=pytest.mark.slow),
        pytest.param("drain", marks=pytest.mark.slow),  # Ray's own notice (`ray drain-node`): `make test-all`
        pytest.param(None, marks=pytest.mark.slow),  # the node dies unannounced
    ],
)
def test_an_elastic_run_grows_when_a_node_joins_and_shrinks_when_one_dies(tmp_path, notice):
    """`scaling.num_workers: [1, 2]` on Ray's fake multi-node provider: the run starts on the one
    node there is, grows to two when the autoscaler adds one, and goes on with one when a node's
    raylet is killed; it finishes with both resizes in the summary and in MLflow. A pipeline that
    writes down every sample it trains on shows 8 samples at every step (2 micro-batches of 4 on
    one worker, 1 on each of two) and every sample once per epoch, across both resizes. With a
    notice first (SIGTERM to the node's worker, as a spot reclaim's shutdown sends), the group
    checkpoints at an agreed step before the node goes, and the shrink redoes no step; the same
    with Ray's own preemption notice (a drain, which Ray Train passes to every worker)."""
    import psutil
    import yaml

    gcs_port = free_port()
    nodes = {
        **FAKE_CLUSTER["available_node_types"],
        "cpu_node": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 1, "max_workers": 2},
    }
    config = {
        **FAKE_CLUSTER,
        "max_workers": 2,
        "available_node_types": nodes,
        "provider": {**FAKE_CLUSTER["provider"], "gcs_address": f"127.0.0.1:{gcs_port}"},
    }
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(config))
    # A dead node is noticed after ~3 s instead of Ray's ~30 s default; a group that cannot start
    # at the old size (Ray's elastic policy tries that first) gives up after 10 s instead of 60.
    head_env = {
        "RAY_FAKE_CLUSTER": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10",
        **ONE_HOST,
    }
    with _head(
        tmp_path, "--num-cpus=0", f"--autoscaling-config={tmp_path / 'cluster.yaml'}", env=head_env, gcs_port=gcs_port
    ) as (_, gcs, temp):
        env = dict(_auth_env(tmp_path), **ONE_HOST, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
        assert wait_for(lambda: _worker_nodes(gcs, env) == 1, 120)
        log = tmp_path / "run.log"
        (tmp_path / "pace").touch()
        (tmp_path / "pipe.py").write_text(RECORDING_PIPELINE)
        (tmp_path / "run.yaml").write_text("pipeline: ./pipe.py\n")
        with open(log, "w") as out:
            run = subprocess.Popen(
                [
                    str(BIN / "raylane"),
                    "train",
                    str(tmp_path / "run.yaml"),
                    "--address",
                    gcs,
                    "--set",
                    f"model.record={tmp_path / 'seen'}",
                    "--set",
                    f"model.pace={tmp_path / 'pace'}",
                    "--set",
                    "train.batch_size=4",
                    "--set",
                    "scaling.num_workers=1,2",
                    "--set",
                    "scaling.resize_check_s=2",
                    "--set",
                    f"train.max_epochs={ELASTIC_EPOCHS}",
                    "--set",
                    "mlflow.log_model=false",
                    "--set",
                    "mlflow.system_metrics=false",
                    "--set",
                    "checkpoint.every_n_epochs=5",
                    "--set",
                    "train.eval_every_n_epochs=100",
                    "--set",
                    f"run.storage_path={tmp_path / 'runs'}",
                    "--summary-json",
                    str(tmp_path / "summary.json"),
                ],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:

            def logged(text: str, timeout_s: float) -> None:  # a timeout shows the run's own lines
                try:
                    wait_for(lambda: text in log.read_text() or run.poll() is not None, timeout_s)
                except TimeoutError:
                    raise AssertionError(f"no {text!r} within {timeout_s} s:\n{log.read_text()[-3000:]}") from None

            logged("worker group restarted (1)", 240)
            assert run.poll() is None, "the run ended before it grew: " + log.read_text()[-3000:]
            raylet = _newest_raylet(temp)
            if notice == "sigterm":
                assert wait_for(lambda: _train_workers(raylet), 30)
                for pid in _train_workers(raylet):
                    os.kill(pid, signal.SIGTERM)
            elif notice == "drain":
                node_id = re.search(r"--node_id=(\w+)", " ".join(psutil.Process(raylet).cmdline())).group(1)
                subprocess.run(
                    [
                        str(BIN / "ray"),
                        "drain-node",
                        "--address",
                        gcs,
                        "--node-id",
                        node_id,
                        "--reason",
                        "DRAIN_NODE_REASON_PREEMPTION",
                        "--reason-message",
                        "spot reclaim",
                        "--deadline-remaining-seconds",
                        "60",
                    ],
                    env=env,
                    check=True,
                    capture_output=True,
                )
            if notice:
                logged("restarts without the leaving node", 60)
            os.kill(raylet, signal.SIGKILL)
            logged("worker group restarted (2)", 240)
            (tmp_path / "pace").unlink()
            assert run.wait(400) == 0, log.read_text()[-4000:]
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
        summary = read_json(tmp_path / "summary.json")
        assert summary["status"] == "FINISHED", summary
        resizes = summary["resizes"]
        assert [(r["from"], r["to"]) for r in resizes[:2]] == [(1, 2), (2, 1)], (resizes, log.read_text()[-6000:])
        assert all(r["time_lost_s"] > 0 for r in resizes), resizes
        assert resizes[0]["steps_lost"] == 0, resizes  # the group handed over before it grew
        if notice:
            assert "notice to 1 of 2 ranks" in resizes[1]["reason"] and resizes[1]["steps_lost"] == 0, resizes
        assert summary["steps"] == ELASTIC_EPOCHS * 5  # 40 samples, 8 a step: every epoch whole, at any size
        resumed = [int(n) for n in re.findall(r"resumed from step (\d+)", log.read_text())]
        trained: dict[int, int] = {}
        steps = _recorded_steps(tmp_path / "seen", resumed, held=8, micro=4, trained=trained)
        assert sorted(steps) == list(range(1, summary["steps"] + 1))
        if notice:  # the two-worker group trained up to the step the one-worker group resumed from
            assert resumed[0] + trained[1] == resumed[1], (resumed, trained)
        assert all(len(v) == 8 for v in steps.values())  # the global batch at every step, at 1 worker or 2
        for epoch in range(ELASTIC_EPOCHS):
            seen = [i for k in range(epoch * 5 + 1, epoch * 5 + 6) for i in steps[k]]
            assert sorted(seen) == list(range(40)), (epoch, seen)  # each sample once, across both resizes
        _, tags = _mlflow_run(tmp_path / "mlflow.db", summary["run_id"])
        assert [(r["from"], r["to"]) for r in json.loads(tags["raylane.resizes"])] == [
            (r["from"], r["to"]) for r in resizes
        ]
