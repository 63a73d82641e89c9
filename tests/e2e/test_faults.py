"""Fault injection: a raising rank, NaN losses, and a worker killed with SIGKILL mid-run."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.loop import checkpoint
from raylane.loop.observe.faults import parse
from raylane.loop.run import build_optimizer
from raylane.pipelines.digits import build_model
from tests.conftest import TORCHRUN, cli_env, read_json, session_processes, wait_for


def test_fault_plan_parsing():
    faults = parse("raise@rank=1,step=5; nan@step=7")
    assert [(f.kind, f.rank, f.step) for f in faults] == [("raise", 1, 5), ("nan", None, 7)]
    with pytest.raises(ValueError, match="cannot parse 'boom@step=1'"):
        parse("boom@step=1")


@pytest.mark.slow  # ~19 s; make test stops on nan@step=7 with this very error (test_resume:
# test_a_failed_run_names_its_newest_valid_checkpoint) and closes the MLflow run FAILED (test_mlflow_server)
def test_nan_stops_with_the_step_named(run_cli, tmp_path):
    proc = run_cli(
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=n",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, RAYLANE_FAULTS="nan@step=7"),
    )
    assert proc.wait(120) == 1
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FAILED"
    assert s["error"] == "FloatingPointError: non-finite loss or gradients at step 7 (train.on_nan: stop)"
    assert MlflowClient(s["tracking_uri"]).get_run(s["run_id"]).info.status == "FAILED"


@pytest.mark.untracked
def test_nan_on_one_rank_is_skipped_on_both(run_cli, tmp_path):
    """Only rank 1's loss is NaN; DDP's all-reduce spreads it, so both ranks skip the same update
    (no divergence, no hang) and the run finishes."""
    proc = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        "train",
        "regression",
        "--set",
        "run.name=skip",
        "--set",
        "train.on_nan=skip",
        "--set",
        "train.max_epochs=1",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, RAYLANE_FAULTS="nan@rank=1,step=3"),
        launcher=TORCHRUN,
    )
    assert proc.wait(180) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["skipped_steps"] == 1 and s["steps"] == 32
    assert all(map(torch.isfinite, map(torch.tensor, s["metrics"].values())))


@pytest.mark.ray
@pytest.mark.shared_ray
@pytest.mark.slow  # ~40 s; make test fails a 2-worker Ray run on rank 1's exception, in this one line, unrestarted
# and within its bound (test_preemption: test_a_rank_stuck_outside_a_collective_is_reported_within_the_timeout);
# the driver closes the MLflow run FAILED on every launcher (test_mlflow_server)
def test_raising_rank_fails_the_run_in_seconds_naming_the_rank(run_cli, tmp_path):
    proc = run_cli(
        "train",
        "regression",
        "--set",
        "run.name=boom",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, RAYLANE_FAULTS="raise@rank=1,step=5"),
    )
    assert proc.wait(180) == 1, proc.output
    s = read_json(tmp_path / "s.json")
    assert s["error"] == "training failed on rank 1: InjectedFault: injected failure on rank 1 at step 5"
    assert s["status"] == "FAILED" and s["restarts"] == 0
    seconds_after_first_step = s["timing"]["launched_unix"] + s["wall_s"] - s["timing"]["first_step_unix"]
    assert seconds_after_first_step < 10
    assert MlflowClient(s["tracking_uri"]).get_run(s["run_id"]).info.status == "FAILED"


def _weights(summary: dict) -> dict[str, torch.Tensor]:
    cfg = load_config("digits")
    model = build_model(cfg.model)
    state = checkpoint.load(summary["checkpoint"], model, build_optimizer(model, cfg))
    assert state["step"] == summary["steps"]
    return model.state_dict()


@pytest.mark.ray
@pytest.mark.untracked
@pytest.mark.slow  # make test has a Ray worker kill itself with SIGKILL and checks the bit-identical end (test_any_model)
def test_killed_worker_restarts_and_ends_bit_identical(run_cli, tmp_path):
    # Long enough (~5 s of steps after the first checkpoint) that the kill lands mid-run.
    epochs = 15
    common = [
        "--set",
        f"train.max_epochs={epochs}",
        "--set",
        "checkpoint.every_n_steps=20",
        "--set",
        "failure.max_failures=1",
    ]
    victim = run_cli(
        "train", "digits", "--set", "run.name=victim", "--summary-json", "victim.json", *common, name="victim"
    )
    # Any committed checkpoint: step 20's own can be pruned (checkpoint.keep) between two polls.
    wait_for(lambda: checkpoint.committed(str(tmp_path / "runs/victim")), timeout_s=240)
    pids = wait_for(lambda: session_processes(victim.proc.pid, "ray::RayTrainWorker"), timeout_s=30)
    os.kill(pids[-1], signal.SIGKILL)  # a plain external kill -9 of one worker process

    # The uninterrupted reference, under torchrun: the same two gloo ranks, seeds and data order as
    # on Ray (the loop knows nothing of its launcher), in a third of the start-up time; started
    # while Ray restarts the victim's workers, which mostly waits.
    calm = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        "train",
        "digits",
        "--set",
        "run.name=calm",
        "--summary-json",
        "calm.json",
        *common,
        name="calm",
        launcher=TORCHRUN,
    )
    assert victim.wait(300) == 0, victim.output
    assert calm.wait(300) == 0, calm.output

    hit, ref = read_json(tmp_path / "victim.json"), read_json(tmp_path / "calm.json")
    assert hit["restarts"] == 1 and ref["restarts"] == 0
    assert hit["status"] == "FINISHED" and hit["steps"] == ref["steps"] == epochs * 23
    resumed = hit["resumed_from_step"]  # checkpoints every 20 steps and at epoch ends (23 steps)
    assert resumed >= 20 and (resumed % 20 == 0 or resumed % 23 == 0)
    assert "worker group restarted (1)" in victim.output
    w_hit, w_ref = _weights(hit), _weights(ref)
    for name, tensor in w_ref.items():
        assert torch.equal(w_hit[name], tensor), name  # bit-identical to the uninterrupted run
    assert hit["metrics"] == ref["metrics"]
