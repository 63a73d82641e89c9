"""A user's pipeline file (a test copies it into its folder as pipe.py: `write_project`) whose
build(cfg) refuses its input with raylane's ConfigError, as raylane.hf.pipeline(cfg, train=...)
does inside a user's own build when a data.mix source has no dataset of its name: bad input that
only build can tell, found on the ranks. LINE is what the run must say of it, in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import raylane
from raylane.config import ConfigError

MESSAGE = "data.x = 3: this pipeline takes 1 or 2"
LINE = f"raylane: invalid config: {MESSAGE}"


class Model(raylane.Section):
    width: int = 4


class Config(raylane.BaseConfig):
    model: Model = Model()


def build(cfg: Config) -> raylane.Pipeline:
    raise ConfigError(MESSAGE)


def write_project(folder: Path) -> Path:
    """This file as `folder`/pipe.py, and `folder`/cfg.yaml naming it (returned)."""
    shutil.copy(__file__, folder / "pipe.py")
    (folder / "cfg.yaml").write_text("pipeline: ./pipe.py\ntrain: {max_epochs: 1, batch_size: 8}\n")
    return folder / "cfg.yaml"
