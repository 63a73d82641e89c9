"""`raylane submit CONFIG`: the job starts in Ray's copy of the submitting folder, so the config
it names must be there, or, on a cluster on this machine, named by its absolute path."""

from __future__ import annotations

import pytest

from raylane.config import ConfigError
from raylane.onray.jobs import config_for_job


def test_a_config_is_named_as_the_job_finds_it(tmp_path, monkeypatch):
    (tmp_path / "proj" / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "sub" / "train.yaml").write_text("pipeline: digits\n")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "train.yaml").write_text("pipeline: digits\n")
    monkeypatch.chdir(tmp_path / "proj")
    assert config_for_job("sub/train.yaml", ".", here=False) == "sub/train.yaml"
    assert config_for_job("./sub/../sub/train.yaml", ".", here=False) == "sub/train.yaml"
    assert config_for_job("digits", ".", here=False) == "digits"  # a shipped pipeline
    outside = str(tmp_path / "other" / "train.yaml")
    assert config_for_job("../other/train.yaml", ".", here=True) == outside
    with pytest.raises(ConfigError, match=r"CONFIG = '../other/train.yaml': outside the folder"):
        config_for_job("../other/train.yaml", ".", here=False)
