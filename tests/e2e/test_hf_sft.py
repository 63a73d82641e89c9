"""Fine-tuning on conversations with the shipped `hf` pipeline (issue 64): JSON Lines of
`{"messages": [...]}` read by `raylane train` in one process, each conversation rendered by the
tokenizer's own chat template (a tiny Llama with a ChatML template, tests/helpers/hf_chat.py),
the loss on the assistant's turns, the examples packed into `model.seq_len`. A run stopped
mid-epoch and run again trains on the same next examples as an uninterrupted one: its losses from
the checkpoint on are bit-exact. Bad input is one line, exit 2, before anything starts."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import cli_env, read_json

pytest.importorskip("transformers")


@pytest.fixture
def chat(tmp_path):
    from tests.helpers import hf_chat

    hf_chat.llama(tmp_path / "model")
    for name, n, seed in (("train", 48, 0), ("eval", 12, 1)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for messages in hf_chat.conversations(n, seed=seed):
                f.write(json.dumps({"messages": messages}) + "\n")
    (tmp_path / "sft.yaml").write_text(
        "pipeline: hf\n"
        "model: {name_or_path: model, seq_len: 128}\n"
        "data: {train: train.jsonl, eval: eval.jsonl, format: json, shuffle_rows: 16}\n"
        "train: {batch_size: 2, max_epochs: 1, seed: 0}\n"
        "optim: {name: adamw, lr: 0.003}\n"
        "checkpoint: {every_n_steps: 3}\n"
        "mlflow: {log_every_n_steps: 1, log_model: false, system_metrics: false}\n"
        "run: {storage_path: runs}\n"
    )
    return tmp_path


def _losses(summary: dict) -> dict[int, float]:
    history = MlflowClient(summary["tracking_uri"]).get_metric_history(summary["run_id"], "train/loss")
    return {m.step: m.value for m in history}


def test_a_run_stopped_mid_epoch_resumes_on_the_same_next_packed_examples(run_cli, chat):
    """One process: an uninterrupted run, and the same run failing at step 5 (a checkpoint at 3)
    then run again: from step 4 on, every step's loss is the uninterrupted run's, bit for bit.
    Both end FINISHED with a held-out loss per answer token."""
    env = cli_env(chat)
    whole = run_cli("train", "sft.yaml", "--local", "--set", "run.name=whole", "--summary-json", "whole.json", env=env)
    assert whole.wait(400) == 0, whole.output
    first = read_json(chat / "whole.json")
    assert first["status"] == "FINISHED" and first["steps"] >= 6, first
    assert 0 < first["metrics"]["loss"] < 10, first["metrics"]

    args = ["train", "sft.yaml", "--local", "--set", "run.name=cut", "--summary-json", "cut.json"]
    cut = run_cli(*args, env=cli_env(chat, RAYLANE_FAULTS="raise@step=5"), name="cut")
    assert cut.wait(400) == 1, cut.output
    again = run_cli(*args, env=cli_env(chat), name="again")
    assert again.wait(400) == 0, again.output
    assert "resumed from step 3" in again.output, again.output
    resumed = read_json(chat / "cut.json")
    assert resumed["status"] == "FINISHED" and resumed["steps"] == first["steps"], resumed
    ours, theirs = _losses(resumed), _losses(first)
    assert [s for s in theirs if s >= 4] and all(ours[s] == theirs[s] for s in theirs if s >= 4), (ours, theirs)
    assert resumed["metrics"]["loss"] == first["metrics"]["loss"]


def test_a_tokenizer_without_a_chat_template_is_one_line_before_start(run_cli, chat):
    from tests.helpers import hf_chat

    hf_chat.chat_tokenizer(None).save_pretrained(chat / "plain")
    p = run_cli("train", "sft.yaml", "--local", "--set", "model.tokenizer_path=plain", env=cli_env(chat))
    assert p.wait(120) == 2, p.output
    (line,) = [x for x in p.output.splitlines() if x.strip()]
    assert line.startswith("raylane: invalid config: model.tokenizer_path") and "chat template" in line, line
