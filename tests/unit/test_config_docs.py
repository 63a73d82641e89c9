"""The config reference: docs/configuration.md is what the config models generate, every key carries
a description where it is declared, and `raylane check --explain KEY` prints one key. In-process,
no Ray."""

from __future__ import annotations

import importlib.util

import pytest

from raylane import config_keys
from raylane.cli import main
from raylane.config import BaseConfig
from tests.conftest import REPO


def generator():
    spec = importlib.util.spec_from_file_location("config_docs", REPO / "scripts" / "config_docs.py")
    docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs)
    return docs


def test_the_page_is_what_the_code_generates():
    page = REPO / "docs" / "configuration.md"
    assert page.read_text() == generator().pages()[page], "docs/configuration.md is stale: run `make docs`"


def test_every_key_of_every_model_has_a_description_and_a_row():
    page = (REPO / "docs" / "configuration.md").read_text()
    models = dict(config_keys.all_models())
    assert {"base", "sweep", "autotune", "digits", "gpt", "hf", "regression", "tabular", "text"} <= set(models)
    for name, model in models.items():
        prefix = f"{name}." if name in ("sweep", "autotune") else ""
        for key in config_keys.keys(model, prefix):
            assert key.description.strip(), f"{name}: {key.key} has no description (Field(description=...))"
            assert f"| `{key.key}` |" in page, f"{name}: {key.key} is not in docs/configuration.md"


def test_a_key_reads_its_type_default_range_and_values_from_its_field():
    by_key = {k.key: k for k in config_keys.keys(BaseConfig)}
    assert (by_key["scaling.num_workers"].type, by_key["scaling.num_workers"].allowed) == ("int", "1 <= x <= 4096")
    assert by_key["optim.momentum"].allowed == "0 <= x < 1" and by_key["optim.lr"].allowed == "0 < x <= 10"
    assert (by_key["strategy.name"].type, by_key["strategy.name"].allowed) == ("str", "ddp, fsdp, auto")
    assert by_key["loader.num_workers"].type == 'int | "auto"'
    assert by_key["checkpoint.init_from"].type == "path | null"
    assert by_key["train.early_stopping"].section and by_key["train.early_stopping.patience"].default == 3
    assert by_key["pipeline"].default is config_keys.REQUIRED


def test_explain_prints_one_key_as_this_config_resolves_it(capsys):
    assert main(["check", "digits", "--set", "train.batch_size=64", "--explain", "train.batch_size"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "train.batch_size" and out[1].startswith("  Samples per worker per micro-batch")
    assert "  type:     int" in out and "  allowed:  1 <= x <= 1000000" in out
    assert "  default:  32" in out and out[-1] == "  resolved: 64"


def test_explain_a_section_that_is_off_and_a_key_inside_it(capsys):
    assert main(["check", "digits", "--explain", "train.early_stopping"]) == 0
    out = capsys.readouterr().out
    assert "  keys:     metric, mode, patience, min_delta" in out and out.endswith("  resolved: null\n")
    assert main(["check", "digits", "--explain", "train.early_stopping.patience"]) == 0
    assert capsys.readouterr().out.endswith("  resolved: - (train.early_stopping is null)\n")


def test_explain_a_pipelines_own_key_and_a_sweep_key(capsys):
    assert main(["check", "gpt-tiny", "--explain", "model.n_head"]) == 0
    out = capsys.readouterr().out
    assert "must divide `n_embd`" in out and "  default:  2" in out and out.endswith("  resolved: 2\n")
    assert main(["check", "digits", "--explain", "sweep.scheduler"]) == 0
    out = capsys.readouterr().out
    assert "  allowed:  fifo, asha, pbt" in out and "not here: a sweep file's key" in out


@pytest.mark.parametrize(
    ("key", "hint"), [("train.batchsize", "train.batch_size"), ("model.hidden", "model.hidden_size")]
)
def test_explain_an_unknown_key_exits_2_naming_it(key, hint, capsys):
    assert main(["check", "digits", "--explain", key]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert (
        err == f"raylane: --explain {key}: not a key of the digits config, a sweep file or autotune "
        f"(did you mean {hint}?)\n"
    )


def test_the_page_fails_when_a_default_changes(monkeypatch):
    """The comparison above is not vacuous: a field whose default changes changes the page."""
    from raylane.config import TrainSection

    docs = generator()
    before = docs.markdown()
    field = TrainSection.model_fields["batch_size"]
    monkeypatch.setattr(field, "default", field.default + 1)
    after = docs.markdown()
    assert before != after and f"| `train.batch_size` | `int` | `{field.default}` |" in after
