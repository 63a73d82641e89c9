"""A real Ray head started by the test (`ray start --head` on 127.0.0.1, its own temp dir and
ports, token authentication on), jobs submitted to it with `ray job submit` and `raylane submit`,
their MLflow runs checked. Every process the head started is killed by the test, by session."""

from __future__ import annotations

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
from pathlib import Path

import pytest

from tests.conftest import REPO, descendants, free_port, session_processes

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


@pytest.fixture
def ray_head(tmp_path):
    gcs_port, dashboard_port = free_port(), free_port()
    temp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # short: Ray's unix socket paths are limited
    env = dict(os.environ, RAY_AUTH_MODE="token", PATH=f"{BIN}:{os.environ['PATH']}", RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path / "head.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs_port}",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", f"--temp-dir={temp}",
         "--num-cpus=4", "--include-dashboard=true"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + 120
        while _answers(f"{url}/api/version") is None:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()
            time.sleep(0.5)
        yield url
    finally:
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


def test_ray_job_submit_and_raylane_submit_on_a_token_authenticated_head(ray_head, tmp_path):
    # Without the token the jobs API refuses.
    assert _answers(f"{ray_head}/api/jobs/") == 401

    db = tmp_path / "mlflow.db"
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_ADDRESS=ray_head, PATH=f"{BIN}:{os.environ['PATH']}")
    runtime_env = {"excludes": [".venv", ".git", "runs", "mlflow.db", "mlartifacts", "test-artifacts", "**/__pycache__"],
                   "env_vars": {"MLFLOW_TRACKING_URI": f"sqlite:///{db}"}}
    train = ["raylane", "train", "pipelines/digits.yaml", "--set", "train.max_epochs=1", "--set", "mlflow.log_model=false",
             "--set", f"run.storage_path={tmp_path / 'runs'}", "--set", "mlflow.system_metrics=false"]
    out = subprocess.run([str(BIN / "ray"), "job", "submit", "--working-dir", str(REPO),
                          "--runtime-env-json", json.dumps(runtime_env), "--", *train],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    job_id = re.search(r"Job '(raysubmit_\w+)' submitted successfully", out.stdout + out.stderr).group(1)
    run_id = re.findall(r"MLflow run id:\s+([0-9a-f]{32})", out.stdout)[-1]
    status, tags = _mlflow_run(db, run_id)
    assert status == "FINISHED"
    assert tags["raylane.ray_job_id"] == job_id  # the run knows which job it came from

    # The same through `raylane submit --follow` (the Jobs SDK handle that `app.submit` returns).
    out = subprocess.run([str(BIN / "raylane"), "submit", "pipelines/digits.yaml", "--address", ray_head, "--follow",
                          *[x for o in train[4::2] for x in ("--set", o)]],
                         cwd=REPO, env=dict(env, MLFLOW_TRACKING_URI=f"sqlite:///{db}"), capture_output=True, text=True,
                         timeout=400)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    job_id, status, run_id = re.search(r"job (raysubmit_\w+): (\w+) \(MLflow run ([0-9a-f]{32})\)", out.stdout).groups()
    assert status == "SUCCEEDED"
    status, tags = _mlflow_run(db, run_id)
    assert status == "FINISHED" and tags["raylane.ray_job_id"] == job_id
