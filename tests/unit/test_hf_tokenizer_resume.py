"""A tokenizer retrained in place is noticed on resume (issue 47, finding 7): the same path, the same
size, every token id another meaning. The hf pipeline's checkpoints record the tokenizer's
fingerprint, LoRA or full fine-tune, and a relaunch on other tokenizer files exits 2 in one line
naming the key, both fingerprints and the fix, before anything starts (`raylane check` runs what
`raylane train` runs first); the worker's load and `raylane export` refuse it too. A LoRA base's
record covers its folder's tokenizer (a pipeline of one's own, tests/helpers/hf_lm.py, records no
tokenizer of its own); one recorded before tokenizers were still resumes. Checkpoints are written
here in one process as a run writes them (tests/helpers/hf_tiny.py)."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import yaml

from raylane import cli
from raylane.loop import checkpoint
from tests.conftest import REPO
from tests.helpers import hf_tiny


def _project(tmp_path, config: dict) -> tuple[str, str]:
    """(the config file, its run's checkpoint)."""
    config = {**config, "run": {"name": "run", "storage_path": str(tmp_path / "runs")}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "cfg.yaml"), hf_tiny.checkpoint(config, tmp_path / "runs" / "run")


def _check(capsys, config_file: str) -> tuple[int, str]:
    capsys.readouterr()  # what making the models printed
    code = cli.main(["check", config_file])
    return code, capsys.readouterr().err.strip()


def _retrain(folder) -> None:
    hf_tiny.tokenizer(retrained=1).save_pretrained(folder)


def _hf(tmp_path, **model) -> dict:
    data = hf_tiny.rows(tmp_path / "data", n=8)
    return {"pipeline": "hf", "model": {"seq_len": 16, **model}, "data": {"train": str(data / "train.jsonl")}}


@pytest.mark.parametrize("case", ["full", "lora-with-model.tokenizer_path"])
def test_a_resume_with_a_tokenizer_retrained_in_place_exits_2_naming_both(tmp_path, capsys, no_work, case):
    """Before: the relaunch resumed (exit 0) with every token id remapped."""
    model = hf_tiny.gpt2(tmp_path / "gpt2")
    if case == "full":
        tok, key, config = model, "model.name_or_path", _hf(tmp_path, name_or_path=str(model))
    else:
        tok, key = tmp_path / "tok", "model.tokenizer_path"
        hf_tiny.tokenizer().save_pretrained(tok)
        config = {**_hf(tmp_path, name_or_path=str(model), tokenizer_path=str(tok)), "lora": {"r": 2}}
    config_file, ck = _project(tmp_path, config)
    assert _check(capsys, config_file) == (0, "")  # the same tokenizer: it resumes
    _retrain(tok)
    code, err = _check(capsys, config_file)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    recorded = checkpoint.read_manifest(ck)["tokenizer"]
    assert recorded["key"] == key and recorded["path"] == str(tok)
    was = recorded["fingerprint"][:12]
    assert err.startswith(
        f"raylane: {key} = '{tok}': run 'run' has a checkpoint ('{ck}') trained with the "
        f"tokenizer '{tok}' (fingerprint {was}); this tokenizer is '{tok}' (fingerprint "
    ), err
    assert err.endswith(
        "so every token id would mean another token. Resume it with the tokenizer it was trained with, or "
        "start a fresh run with --set run.name=run-2"
    ), err


def test_the_workers_load_and_the_export_refuse_a_checkpoint_of_another_tokenizer(tmp_path):
    """What a Ray worker's restart and `raylane export` run (no config check before them)."""
    import torch

    from raylane import api
    from raylane.config import ConfigError, validate
    from raylane.loop import usercode
    from raylane.loop.distributed.fsdp import materialize

    model = hf_tiny.gpt2(tmp_path / "gpt2")
    config = _hf(tmp_path, name_or_path=str(model))
    ck = hf_tiny.checkpoint(config, tmp_path / "runs" / "run")
    _retrain(model)
    pipe = usercode.build_pipeline(validate(config))
    materialize(pipe.model, torch.device("cpu"))  # as a run gives the meta model memory
    with pytest.raises(checkpoint.CheckpointLoadError, match=r"was trained with the tokenizer .*; this run's is "):
        checkpoint.load(ck, pipe.model, torch.optim.SGD(pipe.model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"was trained with the tokenizer"):
        api.export(ck, str(tmp_path / "out"), format="hf")


def test_a_lora_bases_record_covers_its_tokenizer_and_an_older_record_still_resumes(tmp_path, capsys, no_work):
    """A pipeline of one's own with apply_lora (no tokenizer record of its own): the base's record
    has its folder's tokenizer fingerprint, and a retrained one is refused naming both; a base
    recorded before (no tokenizer fingerprint) is not refused for it."""
    import json

    shutil.copy(REPO / "tests" / "helpers" / "hf_lm.py", tmp_path / "pipe.py")
    hf_tiny.llama(tmp_path / "base")
    config = {
        "pipeline": str(tmp_path / "pipe.py"),
        "model": {"name_or_path": str(tmp_path / "base")},
        "lora": {"r": 2},
    }
    config_file, ck = _project(tmp_path, config)
    base = checkpoint.read_manifest(ck)["base"]
    _retrain(tmp_path / "base")
    code, err = _check(capsys, config_file)
    assert code == 2 and len(err.splitlines()) == 1, err

    from raylane.loop.checkpoint.frozen import base_mismatch, fingerprint, set_base, tokenizer_fingerprint

    assert "tokenizer" not in checkpoint.read_manifest(ck)
    now = tokenizer_fingerprint(tmp_path / "base")
    assert base["tokenizer"] != now and base["fingerprint"] == fingerprint(tmp_path / "base")
    assert (
        f"trained on base '{tmp_path / 'base'}' (fingerprint {base['fingerprint'][:12]}, its tokenizer's "
        f"{base['tokenizer'][:12]}); this base is '{tmp_path / 'base'}' (fingerprint {base['fingerprint'][:12]}, "
        f"its tokenizer's {now[:12]}). Resume it on the base it was trained on"
    ) in err, err
    # A manifest from before tokenizers were recorded: its base has no tokenizer fingerprint.
    older = {k: v for k, v in base.items() if k != "tokenizer"}
    model = type("Model", (), {})()
    set_base(model, {"path": str(tmp_path / "base"), "fingerprint": fingerprint(tmp_path / "base")})
    assert base_mismatch(ck, older, model) is None
    assert "its tokenizer's" in base_mismatch(ck, base, model)
    written = tmp_path / "runs" / "run" / checkpoint.checkpoint_name(1) / checkpoint.MANIFEST_FILE
    written.write_text(json.dumps({**json.loads(written.read_text()), "base": older}))
    assert _check(capsys, config_file) == (0, "")
