"""The training loop without Ray: a single process and two gloo ranks under plain torchrun."""

from __future__ import annotations

import pytest
import torch

from raylane.config import load_config
from raylane.loop import checkpoint
from raylane.loop.steps import clip_gradients, plain_parameters
from raylane.pipelines.regression import build
from tests.conftest import TORCHRUN, read_json
from tests.helpers.own_lines import foreign


def _final_weights(summary: dict, pipeline_cfg) -> dict[str, torch.Tensor]:
    pipe = build(pipeline_cfg)
    model = pipe.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = checkpoint.load(summary["checkpoint"], model, optimizer)
    assert state["step"] == summary["steps"]
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.untracked
def test_two_gloo_ranks_equal_one_rank_with_twice_the_batch(run_cli, tmp_path):
    """DDP averages gradients, and the sampler gives 2 ranks exactly the halves of 1 rank's batch:
    the weights after training must agree up to float summation order."""
    common = ["--set", "train.max_epochs=2", "--set", "optim.lr=0.05", "--set", "checkpoint.every_n_steps=0"]
    two = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        "train",
        "regression",
        "--set",
        "run.name=two",
        "--set",
        "train.batch_size=32",
        "--summary-json",
        "two.json",
        *common,
        launcher=TORCHRUN,
    )
    assert two.wait(180) == 0, two.output
    one = run_cli(
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=one",
        "--set",
        "train.batch_size=64",
        "--summary-json",
        "one.json",
        *common,
    )
    assert one.wait(120) == 0, one.output

    s2, s1 = read_json(tmp_path / "two.json"), read_json(tmp_path / "one.json")
    assert (s2["world_size"], s2["backend"], s2["status"]) == (2, "gloo", "FINISHED")
    assert (s1["world_size"], s1["status"]) == (1, "FINISHED")
    # A calm run, default stragglers settings: two identical ranks name no straggler. Its windows
    # (3 in a run by hand, at steps 10, 36, 64) gave the slowest rank 1.08x, 1.52x and 1.03x the
    # other's busy time on the busy machine: one window is noise, a straggler needs 3 running.
    assert s2["stragglers"] == [] and "straggler:" not in two.output, two.output
    assert s2["steps"] == s1["steps"] == 2 * 32  # 2,048 samples / 64 per step, 2 epochs
    cfg = load_config("regression")
    w2, w1 = _final_weights(s2, cfg), _final_weights(s1, cfg)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-5, atol=1e-6)
    # Evaluation is exact on any world size: same weights, same held-out loss.
    assert abs(s2["metrics"]["loss"] - s1["metrics"]["loss"]) < 1e-5


@pytest.mark.slow  # ~33 s; make test resumes mid-epoch bit-exact (test_checkpoint: test_resume_with_dropout_is_bit_exact),
# continuing the same MLflow run and saying so (test_records: test_a_longer_schedule_continues_...)
def test_relaunch_resumes_mid_epoch_and_matches_an_uninterrupted_run(run_cli, tmp_path):
    args = ["train", "regression", "--local", "--set", "checkpoint.every_n_steps=10", "--set", "optim.lr=0.05"]
    first = run_cli(*args, "--set", "run.name=r", "--set", "train.max_steps=30", "--summary-json", "a.json")
    assert first.wait(120) == 0, first.output
    # Side by side: each is one process, and the machine has two cores.
    again = run_cli(*args, "--set", "run.name=r", "--set", "train.max_steps=100", "--summary-json", "b.json")
    straight = run_cli(*args, "--set", "run.name=s", "--set", "train.max_steps=100", "--summary-json", "c.json")
    assert again.wait(120) == 0, again.output
    assert straight.wait(120) == 0, straight.output

    a, b, c = (read_json(tmp_path / f) for f in ("a.json", "b.json", "c.json"))
    assert a["steps"] == 30 and b["resumed_from_step"] == 30 and b["steps"] == 100
    assert "resumed from step 30" in again.output
    assert b["run_id"] == a["run_id"]  # the same MLflow run continues
    cfg = load_config("regression")
    wb, wc = _final_weights(b, cfg), _final_weights(c, cfg)
    for name in wc:
        assert torch.equal(wb[name], wc[name]), name  # bit-exact: resumed at exactly the next batch


@pytest.mark.untracked
def test_a_resume_with_another_batch_size_still_ends_at_max_epochs(run_cli, tmp_path):
    """At an epoch boundary the batch size may change (so the steps per epoch do): the run still
    trains up to train.max_epochs, and a cosine schedule still ends at its last step. Before, the
    resume counted max_epochs x the new steps per epoch from step 0 and ran to 'epoch 8' of 5."""
    args = ["train", "regression", "--local", "--set", "run.name=b", "--set", "optim.schedule=cosine"]
    first = run_cli(*args, "--set", "train.max_epochs=2", "--set", "train.batch_size=64", "--summary-json", "a.json")
    assert first.wait(120) == 0, first.output
    again = run_cli(*args, "--set", "train.max_epochs=3", "--set", "train.batch_size=16", "--summary-json", "b.json")
    assert again.wait(120) == 0, again.output
    a, b = read_json(tmp_path / "a.json"), read_json(tmp_path / "b.json")
    assert a["epochs"] == 2 and b["resumed_from_step"] == a["steps"] and b["epochs"] == 3, (a, b)
    assert b["steps_per_epoch"] == 4 * a["steps_per_epoch"]
    assert b["steps"] == a["steps"] + b["steps_per_epoch"], b  # one more epoch, at the new batch size
    assert f"{b['steps']} in 3 epochs" in again.output and "epoch 4" not in again.output, again.output
    state = torch.load(f"{b['checkpoint']}/{checkpoint.STATE_FILE}", weights_only=True)
    assert checkpoint.state.grouped(state["optim"])["param_groups"][0]["lr"] < 1e-6  # the cosine schedule ended


def test_a_schedule_ends_where_a_resume_moves_the_last_step():
    from raylane.loop.run import build_scheduler

    cfg = load_config("regression", ["optim.schedule=cosine"])
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
    scheduler = build_scheduler(optimizer, cfg, total_steps=100)
    factor = scheduler.lr_lambdas[0]
    assert factor(50) == pytest.approx(0.5) and factor(100) == pytest.approx(0.0)
    scheduler.set_total_steps(60)  # what Trainer.load_state_dict sets after such a resume
    assert factor(30) == pytest.approx(0.5) and factor(60) == pytest.approx(0.0)


@pytest.mark.slow  # ~14 s; make test checks the same params and metrics of a --local digits run
# (test_records: test_the_finished_run_has_its_params_and_metrics_in_mlflow)
def test_single_process_digits_logs_to_mlflow(run_cli, tmp_path):
    proc = run_cli(
        "train",
        "digits",
        "--local",
        "--set",
        "scaling.num_workers=1",
        "--set",
        "train.max_epochs=2",
        "--set",
        "run.name=d1",
        "--summary-json",
        "s.json",
    )
    assert proc.wait(120) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    from mlflow.tracking import MlflowClient

    run = MlflowClient(s["tracking_uri"]).get_run(s["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.hidden_size"] == "128"
    assert set(run.data.metrics) >= {"train/loss", "train/lr", "train/samples_per_s", "eval/loss", "eval/accuracy"}


def test_a_one_process_run_in_a_fresh_interpreter_prints_raylanes_lines_only(run_cli, tmp_path):
    """The suite forks its other one-process runs from a process that imported torch, MLflow and
    transformers already (tests/helpers/zygote.py), where what those say as they are imported
    never reaches a run's output: this one starts as `python -m raylane` does, tracked."""
    proc = run_cli(
        "train",
        "digits",
        "--local",
        *("--set", "scaling.num_workers=1", "--set", "train.max_steps=2", "--set", "mlflow.log_model=false"),
        fresh=True,
    )
    assert proc.wait(120) == 0, proc.output
    assert not foreign(proc.output), "\n".join(foreign(proc.output))


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("max_norm", [None, 0.5, 1e6])
def test_gradient_clipping_is_torchs_bit_for_bit(plain, max_norm):
    """The trainer's norm and clipping (its fast path for plain tensors, and torch's own for
    FSDP's DTensors) give exactly torch.nn.utils.clip_grad_norm_'s norm and gradients."""
    torch.manual_seed(0)
    ours, theirs = (
        [torch.nn.Parameter(torch.zeros(shape)) for shape in [(64, 128), (128,), (3, 3, 8)]] for _ in range(2)
    )
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn(a.shape) * 5
        b.grad = a.grad.clone()
    assert plain_parameters(ours)
    norm, finite = clip_gradients(ours, max_norm, plain=plain)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm or float("inf"))
    assert finite and torch.equal(norm, expected)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.grad, b.grad)
    if max_norm == 0.5:  # clipped: the new norm is max_norm
        assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours])).item() == pytest.approx(0.5)


@pytest.mark.parametrize("plain", [True, False])
def test_a_non_finite_gradient_is_reported_and_left_unclipped(plain):
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    params[0].grad = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    params[1].grad = torch.ones(4)
    norm, finite = clip_gradients(params, 0.1, plain=plain)
    assert not finite and torch.isnan(norm)
    assert torch.equal(params[1].grad, torch.ones(4))  # the step is skipped: nothing scaled
    assert clip_gradients([torch.nn.Parameter(torch.zeros(2))], 0.1, plain=plain) is None  # no gradients


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_a_step_whose_norm_is_not_logged_only_checks_finiteness_and_leaves_gradients_as_they_are(bad):
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    params[0].grad = torch.tensor([1.0, 2.5, 2.0, 3.0] if bad is None else [1.0, bad, 2.0, 3.0])
    params[1].grad = torch.randn(4)
    before = [p.grad.clone() for p in params]
    norm, finite = clip_gradients(params, None, plain=True, norm_wanted=False)
    assert norm is None and finite == (bad is None)
    for p, b in zip(params, before, strict=True):
        torch.testing.assert_close(p.grad, b, rtol=0, atol=0, equal_nan=True)


def test_mixed_dtypes_take_torchs_path():
    assert not plain_parameters(
        [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))]
    )
