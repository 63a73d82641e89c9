"""`raylane train` end to end through a real embedded Ray cluster with 2 gloo workers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO, read_json, wait_for

pytestmark = pytest.mark.ray


def test_digits_on_two_ray_workers(run_cli, tmp_path):
    proc = run_cli("train", str(REPO / "pipelines" / "digits.yaml"),
                   "--set", "scaling.num_workers=2", "--set", "run.name=digits2", "--summary-json", "s.json")
    assert proc.wait(300) == 0, proc.output
    # The embedded cluster goes with the run (the driver skips the interpreter's teardown, so
    # this checks that Ray's own shutdown still ran): no Ray daemon or worker outlives it, and
    # Ray's autoscaler monitor was stopped without reporting itself failed.
    assert wait_for(lambda: not proc.session_pids(), 15)
    assert "autoscaler failed" not in proc.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["error"] is None
    assert s["metrics"]["accuracy"] >= 0.95
    assert (s["world_size"], s["backend"]) == (2, "gloo")
    assert s["epochs"] == 12 and s["steps"] == 12 * math.ceil(1438 / 64)
    assert s["samples_per_s"] > 0 and s["wall_s"] > 0
    assert s["timing"]["launch_to_first_step_s"] > 0
    ckpt = Path(s["checkpoint"])
    assert ckpt.is_dir() and ckpt.name == f"checkpoint_{s['steps']:09d}"
    assert (ckpt / "manifest.json").exists() and (ckpt / ".metadata").exists()
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # one shard per rank
    # The outcome the user reads at the end of the log.
    assert f"MLflow run id: {s['run_id']}" in proc.output and str(ckpt) in proc.output
    assert "mlflow ui --backend-store-uri" in proc.output

    client = MlflowClient(s["tracking_uri"])
    run = client.get_run(s["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "digits2"
    params = run.data.params
    assert params["scaling.num_workers"] == "2" and params["train.batch_size"] == "32"
    assert params["optim.name"] == "adam" and params["pipeline"] == "digits"
    loss = client.get_metric_history(s["run_id"], "train/loss")
    assert [m.step for m in loss] == list(range(10, s["steps"] + 1, 10)) + ([s["steps"]] if s["steps"] % 10 else [])
    acc = client.get_metric_history(s["run_id"], "eval/accuracy")
    assert len(acc) == 12 and acc[-1].value == pytest.approx(s["metrics"]["accuracy"])
    assert loss[-1].value < loss[0].value
