"""The training loop without Ray: a single process and two gloo ranks under plain torchrun."""

from __future__ import annotations

import torch

from app import checkpoint
from app.config import load_config
from pipelines.regression import build
from tests.conftest import TORCHRUN, read_json


def _final_weights(summary: dict, pipeline_cfg) -> dict[str, torch.Tensor]:
    pipe = build(pipeline_cfg)
    model = pipe.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = checkpoint.load(summary["checkpoint"], model, optimizer)
    assert state["step"] == summary["steps"]
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_two_gloo_ranks_equal_one_rank_with_twice_the_batch(run_cli, tmp_path):
    """DDP averages gradients, and the sampler gives 2 ranks exactly the halves of 1 rank's batch:
    the weights after training must agree up to float summation order."""
    common = ["--set", "train.max_epochs=2", "--set", "optim.lr=0.05", "--set", "checkpoint.every_n_steps=0"]
    two = run_cli("--nproc_per_node", "2", "-m", "app", "train", "regression", "--set", "run.name=two",
                  "--set", "train.batch_size=32", "--summary-json", "two.json", *common, launcher=TORCHRUN)
    assert two.wait(180) == 0, two.output
    one = run_cli("train", "regression", "--local", "--set", "run.name=one", "--set", "train.batch_size=64",
                  "--summary-json", "one.json", *common)
    assert one.wait(120) == 0, one.output

    s2, s1 = read_json(tmp_path / "two.json"), read_json(tmp_path / "one.json")
    assert (s2["world_size"], s2["backend"], s2["status"]) == (2, "gloo", "FINISHED")
    assert (s1["world_size"], s1["status"]) == (1, "FINISHED")
    assert s2["steps"] == s1["steps"] == 2 * 32  # 2,048 samples / 64 per step, 2 epochs
    cfg = load_config("regression")
    w2, w1 = _final_weights(s2, cfg), _final_weights(s1, cfg)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-6)
    # Evaluation is exact on any world size: same weights, same held-out loss.
    assert abs(s2["metrics"]["loss"] - s1["metrics"]["loss"]) < 1e-5


def test_relaunch_resumes_mid_epoch_and_matches_an_uninterrupted_run(run_cli, tmp_path):
    args = ["train", "regression", "--local", "--set", "checkpoint.every_n_steps=10", "--set", "optim.lr=0.05"]
    first = run_cli(*args, "--set", "run.name=r", "--set", "train.max_steps=30", "--summary-json", "a.json")
    assert first.wait(120) == 0, first.output
    again = run_cli(*args, "--set", "run.name=r", "--set", "train.max_steps=100", "--summary-json", "b.json")
    assert again.wait(120) == 0, again.output
    straight = run_cli(*args, "--set", "run.name=s", "--set", "train.max_steps=100", "--summary-json", "c.json")
    assert straight.wait(120) == 0, straight.output

    a, b, c = (read_json(tmp_path / f) for f in ("a.json", "b.json", "c.json"))
    assert a["steps"] == 30 and b["resumed_from_step"] == 30 and b["steps"] == 100
    assert "resumed from step 30" in again.output
    assert b["run_id"] == a["run_id"]  # the same MLflow run continues
    cfg = load_config("regression")
    wb, wc = _final_weights(b, cfg), _final_weights(c, cfg)
    for name in wc:
        assert torch.equal(wb[name], wc[name]), name  # bit-exact: resumed at exactly the next batch


def test_single_process_digits_logs_to_mlflow(run_cli, tmp_path):
    proc = run_cli("train", "digits", "--local", "--set", "scaling.num_workers=1", "--set", "train.max_epochs=2",
                   "--set", "run.name=d1", "--summary-json", "s.json")
    assert proc.wait(120) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    from mlflow.tracking import MlflowClient

    run = MlflowClient(s["tracking_uri"]).get_run(s["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.hidden_size"] == "128"
    assert set(run.data.metrics) >= {"train/loss", "train/lr", "train/samples_per_s", "eval/loss", "eval/accuracy"}

