"""Any model as it is (issue 37): a dict batch passed as model(**batch) to a model that returns its
own loss, a `step` of the pipeline's own with a metric, and the first step's one-line errors for
each form. The pipeline is the user's own file (tests/helpers/any_model.py, copied as pipe.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from raylane.loop import checkpoint
from tests.conftest import REPO, TORCHRUN, read_json
from tests.e2e.test_failures import _error_line, _library_log

HELPER = REPO / "tests" / "helpers" / "any_model.py"
CONFIG = "pipeline: ./pipe.py\ntrain: {batch_size: 8, max_epochs: 3}\noptim: {name: adamw, lr: 0.05}\n"


@pytest.fixture
def project(tmp_path) -> Path:
    shutil.copy(HELPER, tmp_path / "pipe.py")
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    return tmp_path


def _weights(path: str) -> dict[str, torch.Tensor]:
    from tests.helpers.any_model import Classifier

    torch.manual_seed(123)  # unlike the checkpoint's, so that a load that misses one shows
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    checkpoint.load(path, model, optimizer)
    return model.state_dict()


def _held_out_loss(weights: dict[str, torch.Tensor]) -> float:
    from tests.helpers.any_model import Classifier, Words

    model = Classifier()
    model.load_state_dict(weights)
    model.eval()
    held_out = Words(24, 1)
    batch = {k: torch.stack([held_out[i][k] for i in range(24)]) for k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():
        return model(**batch)["loss"].item()


# make test's one Ray worker killed with SIGKILL and the group restarted (~26 s): the same with a
# Hugging Face model (tests/e2e/test_hf.py) and with an external kill (tests/e2e/test_faults.py)
# are slow.
@pytest.mark.shared_ray
def test_a_dict_batch_model_with_its_own_loss_on_ray_resumes_bit_exact_after_kill_9_and_logs_its_model(
    run_cli, project, tmp_path, monkeypatch
):
    """On 2 Ray workers, rank 1 kills its own process with SIGKILL after a committed checkpoint
    (model.kill_mark); Ray restarts the group, which resumes and ends bit-identical to the same
    run under torchrun on 2 ranks, FINISHED in MLflow with its model logged."""
    runs = tmp_path / "runs"
    common = ["--set", f"run.storage_path={runs}", "--set", "checkpoint.every_n_steps=2"]
    victim = run_cli(
        "train",
        "cfg.yaml",
        "--set",
        "run.name=victim",
        "--set",
        "scaling.num_workers=2",
        "--set",
        "failure.max_failures=1",
        "--set",
        f"model.kill_mark={tmp_path / 'killed'}",
        "--summary-json",
        "victim.json",
        *common,
        name="victim",
    )
    calm = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        "train",
        "cfg.yaml",
        "--set",
        "run.name=calm",
        "--set",
        "mlflow.enabled=false",
        "--summary-json",
        "calm.json",
        *common,
        name="calm",
        launcher=TORCHRUN,
    )
    assert calm.wait(300) == 0, calm.output
    assert victim.wait(300) == 0, victim.output
    hit, ref = read_json(tmp_path / "victim.json"), read_json(tmp_path / "calm.json")
    assert (tmp_path / "killed").exists()
    assert hit["restarts"] == 1 and ref["restarts"] == 0, victim.output
    assert hit["status"] == "FINISHED" and hit["steps"] == ref["steps"] == 12
    assert hit["resumed_from_step"] and hit["resumed_from_step"] >= 2
    w_hit, w_ref = _weights(hit["checkpoint"]), _weights(ref["checkpoint"])
    for name, tensor in w_ref.items():
        assert torch.equal(w_hit[name], tensor), name
    assert hit["metrics"] == ref["metrics"] and set(hit["metrics"]) == {"loss"}
    # No eval_sums: the model's own loss over every held-out sample once, exactly (24 samples on 2
    # ranks in batches of 8: batches of 8 and 4 on each).
    assert ref["metrics"]["loss"] == pytest.approx(_held_out_loss(w_ref), rel=1e-5)

    client = MlflowClient(hit["tracking_uri"])
    assert client.get_run(hit["run_id"]).info.status == "FINISHED"
    import mlflow.pytorch

    # Where models:/ URIs resolve; not mlflow.set_tracking_uri, which would outlive this test.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", hit["tracking_uri"])

    served = mlflow.pytorch.load_model(hit["model_uri"])  # inputs named by the signature, in its order
    signature = mlflow.models.get_model_info(hit["model_uri"]).signature
    assert signature.inputs.input_names() == ["input_ids", "attention_mask"]
    logits = served(torch.randint(0, 16, (3, 6)), torch.ones(3, 6))
    assert logits.shape == (3, 3)


def test_a_step_with_a_metric_of_its_own_trains_to_finished_and_logs_the_metric(run_cli, project, tmp_path):
    p = run_cli(
        "train",
        "cfg.yaml",
        "--local",
        "--set",
        "model.mode=step",
        "--set",
        "mlflow.log_every_n_steps=4",
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
        "--summary-json",
        "s.json",
    )
    assert p.wait(180) == 0, p.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["steps"] == 24
    client = MlflowClient(s["tracking_uri"])
    run = client.get_run(s["run_id"])
    assert run.info.status == "FINISHED"
    train = client.get_metric_history(s["run_id"], "train/my_metric")
    assert [m.step for m in train] == [4, 8, 12, 16, 20, 24]
    assert all(m.value > 0 for m in train)
    assert "eval/my_metric" in run.data.metrics and "eval/loss" in run.data.metrics
    assert s["model_uri"]  # from the pipeline's example_input: the two inputs


ERRORS = {
    "bad keys": "the batch is a dict, passed as model(**batch), and the model's forward takes no 'token_type_ids': "
    "the batch's keys are [input_ids, attention_mask, labels, token_type_ids], forward's parameters "
    "(input_ids, attention_mask, labels) (at {pipe}:{forward})",
    "no loss": "the model's output is dict with keys [logits], with no loss, and the pipeline gives no loss_fn: "
    "expected output.loss, output['loss'] or a one-number tensor, or give loss_fn(output, batch) "
    "(the model's forward at {pipe}:{forward})",
    "bad step": "step(model, batch) returned dict with keys [loss]: expected the loss (a one-number tensor) or "
    "(loss, {{metric: value}}) (at {pipe}:{bad_return})",
}


@pytest.mark.untracked
def test_a_batch_output_or_step_of_the_wrong_form_is_one_line_at_the_first_step(run_cli, project, tmp_path):
    """Keys the model's forward does not take (said before the forward runs), an output with no
    loss and no loss_fn, a step that returns something else: one line each, no traceback."""
    pipe = tmp_path / "pipe.py"
    lines = pipe.read_text().splitlines()
    forward = next(i for i, line in enumerate(lines, 1) if "def forward(self, input_ids" in line)
    bad_return = next(i for i, line in enumerate(lines, 1) if 'return {"loss": ((model(a, b)' in line)
    runs = {
        mode: run_cli(
            "train",
            "cfg.yaml",
            "--local",
            "--set",
            f"model.mode={mode}",  # at once: start-up overlaps
            "--set",
            f"run.name=case{i}",
            "--set",
            f"run.storage_path={tmp_path / 'runs'}",
            "--summary-json",
            f"{i}.json",
            name=f"case{i}",
        )
        for i, mode in enumerate(ERRORS)
    }
    for i, (mode, expected) in enumerate(ERRORS.items()):
        p = runs[mode]
        assert p.wait(240) == 1, (mode, p.output)
        line = _error_line(p.output)
        text = expected.format(pipe=pipe, forward=forward, bad_return=bad_return)
        assert line.strip() == f"error:         pipeline {str(pipe)!r}: {text}", (mode, line)
        assert "Traceback" in _library_log(p.output), mode
        assert not read_json(tmp_path / f"{i}.json")["steps"], mode


def test_to_device_moves_every_tensor_of_any_nesting_and_keeps_the_containers():
    """On the meta device (any device but the CPU shows a tensor moved): a tokenizer-like
    UserDict, a namedtuple, a dataclass, lists and tuples, with values that are no tensors."""
    import collections
    import dataclasses

    from raylane.loop.protocols.batches import to_device

    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Item:
        x: torch.Tensor
        name: str

    class Encoding(collections.UserDict):
        pass

    batch = {
        "enc": Encoding(input_ids=torch.ones(2, 3)),
        "pair": Pair(torch.ones(2), [torch.ones(1), 7]),
        "item": Item(torch.ones(2), "n"),
        "t": (torch.ones(1), "s"),
    }
    moved = to_device(batch, torch.device("meta"))
    assert type(moved["enc"]) is Encoding and moved["enc"]["input_ids"].is_meta
    assert type(moved["pair"]) is Pair and moved["pair"].a.is_meta and moved["pair"].b[0].is_meta
    assert moved["pair"].b[1] == 7
    assert type(moved["item"]) is Item and moved["item"].x.is_meta and moved["item"].name == "n"
    assert moved["t"][0].is_meta and moved["t"][1] == "s"
    assert not batch["enc"]["input_ids"].is_meta  # the batch itself is left as it was


def test_a_pipeline_with_both_step_and_eval_sums_or_a_collate_fn_that_is_no_function_is_refused():
    """At build(cfg), in one line (before: the held-out batch went to the model in the batch's
    generic form and failed with a TypeError naming no pipeline; a str collate_fn failed in the
    loader)."""
    from raylane import Pipeline
    from raylane.loop.usercode import pipeline_problem

    data = [(torch.zeros(2), torch.zeros(1))]
    model = torch.nn.Linear(2, 1)
    both = Pipeline(model=model, train_set=data, step=lambda m, b: m(b[0]).sum(), eval_sums=lambda o, b: {})
    assert pipeline_problem(both).startswith(
        "a Pipeline with both step and eval_sums: with a step, the held-out metrics are its loss and metrics"
    )
    assert (
        pipeline_problem(Pipeline(model=model, train_set=data, collate_fn="pad"))
        == "a Pipeline whose collate_fn is str, not a function"
    )


def test_autotune_counts_the_evaluations_every_n_steps_in_a_steps_cost():
    from raylane.autotuning.costs import per_step_seconds
    from raylane.config import load_config

    epochs_only = load_config("digits", ["train.eval_every_n_epochs=0", "checkpoint.every_n_epochs=0"])
    every_10 = load_config(
        "digits", ["train.eval_every_n_epochs=0", "checkpoint.every_n_epochs=0", "train.eval_every_n_steps=10"]
    )
    assert per_step_seconds(epochs_only, steps_per_epoch=50, eval_s=2.0, save_s=0.0) == 0.0
    assert per_step_seconds(every_10, steps_per_epoch=50, eval_s=2.0, save_s=0.0) == pytest.approx(0.2)
