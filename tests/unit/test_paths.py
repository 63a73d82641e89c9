"""Paths in a config, resolved once on the driver (raylane.paths): an input written in a config
file is relative to that file's folder, anything else (`--set`, outputs, defaults) to the working
directory, and every worker gets the absolute path, whatever its own working directory."""

from __future__ import annotations

import pytest
import yaml

from raylane import api
from raylane.config import ConfigError, load_config
from raylane.paths import path_keys
from tests.conftest import REPO

CSV = "a,b,label\n" + "".join(f"{i % 5 / 5:.2f},{(i * 7) % 3 / 3:.2f},{i % 2}\n" for i in range(256))


def _project(root):
    """A copy of the shipped tabular.yaml in a project folder, pointed at CSV data beside it."""
    project = root / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "train.csv").write_text(CSV)
    config = yaml.safe_load((REPO / "pipelines" / "tabular.yaml").read_text())
    config["data"].update(train="data/train.csv", format="csv", features=["a", "b"], target="label")
    (project / "tabular.yaml").write_text(yaml.safe_dump(config))
    return project


def test_an_input_in_a_config_file_is_relative_to_its_folder(tmp_path, monkeypatch):
    project = _project(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = api.check("../project/tabular.yaml")
    assert cfg.data.train == str(project / "data" / "train.csv")
    assert cfg.run.storage_path == str(elsewhere / "runs")  # an output: beside the working directory's mlflow.db
    # --set is typed in the working directory: relative to it.
    monkeypatch.chdir(project)
    assert api.check("tabular.yaml", ["data.train=data/train.csv"]).data.train == str(project / "data" / "train.csv")
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ConfigError, match=f"data.train = '{elsewhere}/data/train.csv': no csv files there"):
        api.check("../project/tabular.yaml", ["data.train=data/train.csv"])


def test_a_shipped_config_is_a_template_relative_to_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.txt").write_text("hello world\n" * 50)
    monkeypatch.chdir(tmp_path)
    assert api.check("text").data.train == str(tmp_path / "data" / "corpus.txt")


def test_path_keys_are_found_by_type_in_every_section():
    from raylane.pipelines.gpt import Config as Gpt
    from raylane.pipelines.tabular import Config as Tabular

    keys = path_keys(Tabular)
    assert {k: v.must_exist for k, v in keys.items()} == {
        "run.storage_path": False,
        "checkpoint.init_from": True,
        "data.train": True,
        "data.eval": True,
    }
    assert set(path_keys(Gpt)) == {"run.storage_path", "checkpoint.init_from", "data.text_path"}


def test_uris_home_and_mappings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_config({"pipeline": "digits", "run": {"storage_path": "s3://bucket/runs"}})
    assert cfg.run.storage_path == "s3://bucket/runs"
    cfg = load_config({"pipeline": "digits", "run": {"storage_path": "~/runs"}})
    assert cfg.run.storage_path == str(tmp_path / "home" / "runs")
    given = {"pipeline": "digits", "run": {"storage_path": "out"}}
    assert load_config(given).run.storage_path == str(tmp_path / "out")
    assert given["run"]["storage_path"] == "out"  # the caller's mapping is left as it was


def test_a_hub_id_is_told_from_a_path():
    """A model path (raylane.paths.ModelPath) that reads as a Hugging Face hub id stays as written
    where no folder of that name is (raylane.hf.hub resolves it); a path never reads as one."""
    from raylane.paths import is_hub_id

    assert all(map(is_hub_id, ["gpt2", "openai-community/gpt2", "Qwen/Qwen1.5-MoE-A2.7B", "a_b.c"]))
    for path in ["./gpt2", "/models/gpt2", "~/gpt2", "a/b/c", "org--x/y", "../x", "x/..", "", "gpt2.", "x.git"]:
        assert not is_hub_id(path), path
