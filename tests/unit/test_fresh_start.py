"""A relaunch from another folder that finds no run says so. Outputs (run.storage_path) are
relative to the working directory, so the same config launched from the folder above its own
starts a fresh run there; before, it did so without a word. A launch that names its run and
finds no run of that name says where it looked; a generated name (always new) says nothing."""

from __future__ import annotations

import logging

from raylane.config import load_config
from raylane.driver import finalize_run
from raylane.session import RunSession


def _launch(config, overrides=()) -> tuple[str, list[str]]:
    """The run name the driver settles on, and the lines it says while doing so."""
    cfg = load_config(config, list(overrides))
    handler, logger = _Lines(), logging.getLogger("raylane")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # as the commands set it (raylane.logs)
    try:
        with RunSession() as session:  # the run's lease, given back on leaving
            name = finalize_run(cfg, session, is_driver=True).run.name
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return name, handler.lines


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_named_run_relaunched_from_another_folder_says_it_starts_afresh(tmp_path, monkeypatch):
    project = tmp_path / "myllm"
    project.mkdir()
    (project / "cfg.yaml").write_text("pipeline: regression\nrun: {name: mine}\n")
    (project / "runs" / "mine").mkdir(parents=True)  # its first launch, from its own folder
    monkeypatch.chdir(project)
    assert _launch("cfg.yaml") == ("mine", [])  # found: a resume, nothing to say

    monkeypatch.chdir(tmp_path)
    assert _launch("myllm/cfg.yaml") == ("mine", ["no run 'mine' under ./runs: starting a fresh one"])
    assert _launch("myllm/cfg.yaml", ["run.storage_path=out/r"]) == (
        "mine",
        ["no run 'mine' under ./out/r: starting a fresh one"],
    )
    name, lines = _launch("myllm/cfg.yaml", ["run.name=null"])
    assert name.startswith("regression-") and lines == []  # a generated name is always new
