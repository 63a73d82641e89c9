"""The MLflow model and the export of Hugging Face models that are not the example's LLaMA (issue 47):
a GPT-2 run's MLflow model predicts on text (finding 3: its class, GPT2LMHeadModel, was logged
with the PyTorch flavour, as its name does not end in ForCausalLM), and so does a classifier's; an exported GPT-2 classifier's tokenizer carries the pad token the run padded with
(finding 13). One real run (`--local`, 2 steps) proves the end of a run; the others are logged by
the function the end of a run calls (raylane.tracking.records.log_model) from a checkpoint of the
hf pipeline's model written here. Tiny models: tests/helpers/hf_tiny.py."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("mlflow")

import torch

from tests.conftest import cli_env, read_json
from tests.helpers import hf_tiny

PROMPT = "w5 w6 w7"


def _config(tmp_path, model, **model_keys) -> dict:
    data = hf_tiny.rows(tmp_path / "data")
    return {
        "pipeline": "hf",
        "model": {"name_or_path": str(model), "seq_len": 16, **model_keys},
        "data": {"train": str(data / "train.jsonl"), "eval": str(data / "eval.jsonl")},
        "train": {"max_steps": 2, "batch_size": 4},
    }


def _checkpoint(tmp_path, config: dict) -> str:
    return hf_tiny.checkpoint(config, tmp_path / "runs" / "run")


def _logged(tmp_path, monkeypatch, ck: str) -> str:
    """The model URI of `ck` logged as the end of a run logs it."""
    import mlflow
    import mlflow.tracking._tracking_service.utils as tracking

    from raylane.tracking.records import log_model
    from raylane.tracking.runs import RunHandle

    # log_model sets the process's tracking URI (as the driver's end of run does): not beyond this test.
    monkeypatch.setattr(tracking, "_tracking_uri", tracking._tracking_uri)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("hf", artifact_location=str(tmp_path / "artifacts")))
    return log_model(RunHandle(run.info.run_id, run.info.experiment_id, uri, resumed=False), ck, None)["model_uri"]


def test_a_gpt2_runs_mlflow_model_generates_text(run_cli, tmp_path, monkeypatch):
    """A LoRA fine-tune of a GPT-2 (GPT2LMHeadModel) on one process: the model the run logs at its
    end is the transformers flavour's text-generation, and `predict(["some text"])` continues the
    text. Before, it was the PyTorch flavour: 'Model is missing inputs ['input_ids']'."""
    import mlflow
    import mlflow.pyfunc
    import yaml

    config = _config(tmp_path, hf_tiny.gpt2(tmp_path / "gpt2"))
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({**config, "lora": {"r": 2}}))
    p = run_cli("train", "cfg.yaml", "--local", "--summary-json", "run.json")
    assert p.wait(300) == 0, p.output
    assert "PyTorch flavour" not in p.output and "could not record" not in p.output, p.output
    summary = read_json(tmp_path / "run.json")
    import mlflow.tracking._tracking_service.utils as tracking

    monkeypatch.setattr(tracking, "_tracking_uri", tracking._tracking_uri)  # not beyond this test
    mlflow.set_tracking_uri(cli_env(tmp_path)["MLFLOW_TRACKING_URI"])
    model = mlflow.pyfunc.load_model(summary["model_uri"])
    assert model.metadata.flavors["transformers"]["task"] == "text-generation"
    out = model.predict([PROMPT])
    assert isinstance(out[0], str) and out[0].startswith(PROMPT) and len(out[0].split()) > 3, out


def test_the_mlflow_model_of_a_gpt2_classifier_classifies_text_and_pads_as_the_run_did(tmp_path, monkeypatch):
    """A GPT-2 classifier (its base a GPT2LMHeadModel folder, its tokenizer without a pad token)
    classifies, and its logged tokenizer pads with the token the run padded with (the model's
    pad_token_id: GPT-2's EOS). A LLaMA's MLflow model generating text is
    tests/e2e/test_hf_lora.py::test_the_mlflow_model_of_a_lora_run_is_the_merged_transformers_model_and_generates."""
    import mlflow.pyfunc
    import mlflow.transformers

    classifier = {"task": "sequence-classification", "num_labels": 2}
    uri = _logged(
        tmp_path, monkeypatch, _checkpoint(tmp_path, _config(tmp_path, hf_tiny.gpt2(tmp_path / "gpt2"), **classifier))
    )
    model = mlflow.pyfunc.load_model(uri)
    assert model.metadata.flavors["transformers"]["task"] == "text-classification"
    out = model.predict([PROMPT, "w9 w30"])
    assert len(out) == 2 and set(out["label"]) <= {"LABEL_0", "LABEL_1"}, out
    tokenizer = mlflow.transformers.load_model(uri, return_type="components")["tokenizer"]
    assert tokenizer.pad_token == hf_tiny.EOS


def test_an_exported_gpt2_classifier_pads_batches_as_the_run_did(tmp_path):
    """`raylane export --format hf` of a GPT-2 classifier: its tokenizer has the pad token the run
    used (before: none, and `tokenizer(texts, padding=True)` raised), and a padded batch gives
    each text the logits it has alone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from raylane import api

    classifier = {"task": "sequence-classification", "num_labels": 2}
    ck = _checkpoint(tmp_path, _config(tmp_path, hf_tiny.gpt2(tmp_path / "gpt2"), **classifier))
    api.export(ck, str(tmp_path / "out"), format="hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert tok.pad_token == hf_tiny.EOS and tok.pad_token_id == model.config.pad_token_id
    texts = ["w5 w6 w7 w8 w9", "w40"]
    with torch.no_grad():
        batch = model(**tok(texts, padding=True, return_tensors="pt")).logits
        alone = torch.cat([model(**tok([t], return_tensors="pt")).logits for t in texts])
    assert torch.allclose(batch, alone, atol=1e-5), (batch, alone)
