"""MLflow over a real `mlflow server` on loopback: status on every way out, metric histories,
params and tags, checkpoint records, the logged and registered model, plots, system metrics,
and a server outage in the middle of a run."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import mlflow.pytorch
import pytest
import torch
from mlflow.tracking import MlflowClient

from raylane.pipelines.digits import load_split
from tests.conftest import cli_env, read_json, wait_for


def _expected_steps(total: int, every: int = 10) -> list[int]:
    return list(range(every, total + 1, every)) + ([total] if total % every else [])


# Slow (~14 s): make test records Ray runs on this real server in the ASHA sweep (trials, registered
# model, artifacts: tests/e2e/test_tune.py) and loses no metric when it goes down (below), and
# checks a 2-worker run's records against its summary in tests/e2e/test_ray_e2e.py.
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.shared_ray
def test_a_run_on_two_workers_is_fully_recorded(run_cli, tmp_path, shared_mlflow_server, monkeypatch):
    proc = run_cli(
        "train",
        "digits",
        "--set",
        "run.name=full",
        "--set",
        "mlflow.system_metrics_interval_s=1",
        "--register",
        "digits-mlp",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, MLFLOW_TRACKING_URI=shared_mlflow_server.uri),
    )
    assert proc.wait(300) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    assert s["tracking_uri"] == shared_mlflow_server.uri
    client = MlflowClient(shared_mlflow_server.uri)
    run = client.get_run(s["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "full"

    tags = run.data.tags
    assert {
        k: tags[k]
        for k in (
            "raylane.strategy",
            "raylane.world_size",
            "raylane.backend",
            "raylane.device_type",
            "raylane.pipeline",
        )
    } == {
        "raylane.strategy": "ddp",
        "raylane.world_size": "2",
        "raylane.backend": "gloo",
        "raylane.device_type": "cpu",
        "raylane.pipeline": "digits",
    }
    assert tags["raylane.version"] and tags["raylane.host"]
    assert run.data.params["optim.lr"] == "0.003" and run.data.params["scaling.num_workers"] == "2"

    history = {k: client.get_metric_history(s["run_id"], k) for k in ("train/loss", "train/lr", "eval/accuracy")}
    assert [m.step for m in history["train/loss"]] == _expected_steps(s["steps"])
    assert len(history["train/lr"]) == len(history["train/loss"])
    assert len(history["eval/accuracy"]) == s["epochs"] == 12
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics)  # rank 0's node

    # Every committed checkpoint: in the run's metrics, and listed with its location and metrics.
    records = json.loads(Path(client.download_artifacts(s["run_id"], "checkpoints.json", str(tmp_path))).read_text())[
        "checkpoints"
    ]
    steps_per_epoch = s["steps"] // 12
    expected = sorted({*range(100, s["steps"], 100), *range(steps_per_epoch, s["steps"] + 1, steps_per_epoch)})
    assert [r["step"] for r in records] == expected
    assert records[-1]["location"] == s["checkpoint"] and records[-1]["metrics"] == s["metrics"]
    assert [m.step for m in client.get_metric_history(s["run_id"], "checkpoint/step")] == expected
    assert tags["raylane.checkpoint.latest"] == s["checkpoint"]

    # The final model: loads with mlflow.pytorch and predicts as well as the run said.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared_mlflow_server.uri)  # where models:/ URIs resolve
    model = mlflow.pytorch.load_model(s["model_uri"])
    x, y = load_split()[1].tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(s["metrics"]["accuracy"], abs=1e-6)
    version = client.get_model_version("digits-mlp", s["registered_model"]["version"])
    assert version.run_id == s["run_id"] and version.status == "READY"
    plots = {a.path for a in client.list_artifacts(s["run_id"], "plots")}
    assert plots == {"plots/loss.png", "plots/eval_metrics.png", "plots/throughput.png"}


# A run that trains until the test stops it sleeps 20 ms in each step: it still takes hundreds of
# steps while it waits, and leaves the CPU to the tests beside it (flat out, one took 27 CPU-s).
IDLING = "slow@rank=0,ms=20"


def test_failed_and_interrupted_runs_are_closed_with_their_status(run_cli, tmp_path, shared_mlflow_server):
    failed = run_cli(
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=nan",
        "--summary-json",
        "f.json",
        env=cli_env(tmp_path, MLFLOW_TRACKING_URI=shared_mlflow_server.uri, RAYLANE_FAULTS="nan@step=5"),
    )
    # Side by side: each is one process, and the machine has two cores.
    stopped = run_cli(
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=stop",
        "--set",
        "train.max_epochs=100000",
        "--summary-json",
        "k.json",
        env=cli_env(tmp_path, MLFLOW_TRACKING_URI=shared_mlflow_server.uri, RAYLANE_FAULTS=IDLING),
    )
    assert failed.wait(120) == 1, failed.output
    wait_for(lambda: "[raylane] epoch" in stopped.output, timeout_s=120)
    stopped.signal(signal.SIGINT)
    assert stopped.wait(120) == 130, stopped.output
    client = MlflowClient(shared_mlflow_server.uri)
    f, k = read_json(tmp_path / "f.json"), read_json(tmp_path / "k.json")
    assert client.get_run(f["run_id"]).info.status == "FAILED"
    assert client.get_run(k["run_id"]).info.status == "KILLED"
    assert "model" not in {a.path for a in client.list_artifacts(k["run_id"])}  # only finished runs get one


def test_server_down_mid_run_loses_no_metric(run_cli, tmp_path, mlflow_server):
    proc = run_cli(
        "train",
        "digits",
        "--local",
        "--set",
        "run.name=outage",
        "--set",
        "train.max_epochs=100000",
        "--set",
        "mlflow.system_metrics=false",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, MLFLOW_TRACKING_URI=mlflow_server.uri, RAYLANE_FAULTS=IDLING),
    )
    client = MlflowClient(mlflow_server.uri)
    run_id = wait_for(
        lambda: (
            [r.info.run_id for r in client.search_runs([client.get_experiment_by_name("raylane").experiment_id])]
            if client.get_experiment_by_name("raylane")
            else []
        ),
        timeout_s=120,
    )[0]
    logged_before = wait_for(lambda: client.get_metric_history(run_id, "train/loss"), timeout_s=60)[-1].step
    mlflow_server.stop()
    # Longer than the client's whole retry cycle (3 retries, backoff 1 s: ~7 s), so at least one
    # flush fails outright and its metrics must wait in the buffer.
    time.sleep(12)
    assert proc.proc.poll() is None  # training went on without its server
    mlflow_server.start()
    time.sleep(3)
    proc.signal(signal.SIGTERM)  # a graceful stop: the run ends at a step we know
    assert proc.wait(180) == 130, proc.output
    s = read_json(tmp_path / "s.json")
    assert "metrics stay buffered" in proc.output
    assert client.get_run(run_id).info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == _expected_steps(s["steps"])
    assert len(client.get_metric_history(run_id, "eval/accuracy")) == s["epochs"]
    # It trained through the outage: ~1,000 steps on a quiet machine, 462 with 2 cores at load 25.
    assert s["steps"] > logged_before + 100


@pytest.mark.slow  # an option's copy; make test records checkpoints by location (the first test here)
def test_checkpoints_copied_as_artifacts_when_asked(run_cli, tmp_path, shared_mlflow_server):
    proc = run_cli(
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=copies",
        "--set",
        "mlflow.log_checkpoints=artifacts",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, MLFLOW_TRACKING_URI=shared_mlflow_server.uri),
    )
    assert proc.wait(120) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    name = Path(s["checkpoint"]).name
    copied = {a.path for a in MlflowClient(shared_mlflow_server.uri).list_artifacts(s["run_id"], f"checkpoints/{name}")}
    assert {f"checkpoints/{name}/manifest.json", f"checkpoints/{name}/state.pt"} <= copied


@pytest.mark.slow  # make test trains through a server that goes down mid-run (test_server_down_mid_run_loses_no_metric)
def test_an_unreachable_server_does_not_stop_training(run_cli, tmp_path):
    from tests.conftest import free_port

    proc = run_cli(
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=alone",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{free_port()}"),
    )
    assert proc.wait(180) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["run_id"] is None
    warning = next(line for line in proc.output.splitlines() if "cannot be reached" in line)
    # one short line: the cause, not MLflow's several hundred characters of retries and URLs
    assert warning.endswith("cannot be reached (Connection refused): training without tracking"), warning
