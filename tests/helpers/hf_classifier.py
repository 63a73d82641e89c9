"""A user's pipeline that hands Hugging Face `datasets.Dataset`s to raylane.hf.pipeline: a
sequence classifier on rows read into memory (here from JSON Lines, as a user's own loading
code would)."""

from __future__ import annotations

import json
from pathlib import Path

import raylane
import raylane.hf


class Source(raylane.Section):
    rows: raylane.InputPath  # a folder of JSON Lines files: {"text", "label"} per line


class Config(raylane.hf.Config):
    source: Source


def _dataset(folder: Path):
    import datasets

    rows = [json.loads(line) for file in sorted(folder.glob("*.jsonl")) for line in file.read_text().splitlines()]
    return datasets.Dataset.from_list(rows)


def build(cfg: Config):
    root = Path(cfg.source.rows)
    return raylane.hf.pipeline(cfg, train=_dataset(root / "train"), eval=_dataset(root / "eval"))
