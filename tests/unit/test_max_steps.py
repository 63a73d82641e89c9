"""`train.max_steps` means what it says: a run that sets it runs that many steps, over as many
epochs as they take, unless `train.max_epochs` is set lower; and the line a relaunch of a run
already FINISHED prints names the key that would train it further. Before, the default
`max_epochs: 1` capped `max_steps` at one epoch, and the hint said "raise train.max_epochs or
train.max_steps" whichever limit had stopped the run."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from raylane import prechecks, runrecord
from raylane.config import EPOCHS_AS_NEEDED, load_config, validate
from raylane.loop.data.loader import build_loader
from raylane.loop.steps import plan_steps


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("yaml_train", "sets", "epochs"),
    [
        ("{max_steps: 200}", [], EPOCHS_AS_NEEDED),  # max_steps alone: as many epochs as it takes
        ("{}", ["train.max_steps=200"], EPOCHS_AS_NEEDED),  # from --set alike
        ("{max_epochs: 2}", ["train.max_steps=200"], 2),  # the file's explicit max_epochs still caps it
        ("{max_steps: 200}", ["train.max_epochs=1"], 1),  # and an explicit 1 too
        ("{}", [], 1),  # neither: one epoch
    ],
)
def test_max_epochs_follows_max_steps_unless_set(tmp_path, yaml_train, sets, epochs):
    cfg = load_config(_write(tmp_path / "c.yaml", f"pipeline: regression\ntrain: {yaml_train}\n"), sets)
    assert cfg.train.epoch_limit == epochs
    # Validated again with every key set (Ray's workers, a checkpoint's record): the same.
    assert validate(cfg.model_dump(mode="json")).train.epoch_limit == epochs


def test_a_sweeps_trial_that_sets_max_steps_runs_that_many_steps(tmp_path):
    """A trial's values are set on a base validated with every key set (Ray's workers receive it
    so): a trial that searches train.max_steps on a base that left max_epochs alone still trains
    as many epochs as its steps take. Before, the base's max_epochs had been written 1 by then."""
    from raylane.config import apply_values

    base = validate(load_config(_write(tmp_path / "c.yaml", "pipeline: regression\n")).model_dump(mode="json"))
    assert base.train.epoch_limit == 1
    assert apply_values(base, {"train.max_steps": 200}).train.epoch_limit == EPOCHS_AS_NEEDED
    assert apply_values(base, {"train.max_steps": 200, "train.max_epochs": 2}).train.epoch_limit == 2


def test_a_run_with_max_steps_plans_that_many_steps_over_several_epochs(tmp_path):
    cfg = load_config({"pipeline": "regression", "train": {"batch_size": 8, "max_steps": 25}})
    data = TensorDataset(torch.zeros(80, 1))  # 10 steps an epoch
    loader = build_loader(data, batch_size=8, rank=0, world_size=1, seed=0, shuffle=True)
    assert plan_steps(loader, cfg.train) == (10, 25)


def _finished_run(tmp_path, steps: int, epochs: int) -> None:
    folder = tmp_path / "runs" / "r"
    folder.mkdir(parents=True)
    summary = {"status": "FINISHED", "steps": steps, "epochs": epochs, "checkpoint": "c", "run_id": None}
    (folder / runrecord.RUN_RECORD).write_text(json.dumps({"status": "FINISHED", "summary": summary}))


@pytest.mark.parametrize(
    ("train", "hint"),
    [
        # 68 steps, one whole epoch: a longer max_steps continues it, as the docs promise.
        ({"max_steps": 300}, None),
        ({"max_steps": 68}, "raise train.max_steps to train it further"),
        ({}, "raise train.max_epochs to train it further"),
        ({"max_steps": 300, "max_epochs": 1}, "raise train.max_epochs to train it further"),
        ({"max_steps": 50, "max_epochs": 1}, "raise train.max_steps and train.max_epochs to train it further"),
    ],
)
def test_the_finished_line_names_the_limit_that_stopped_the_run(tmp_path, monkeypatch, train, hint):
    monkeypatch.chdir(tmp_path)
    _finished_run(tmp_path, steps=68, epochs=1)
    cfg = load_config({"pipeline": "regression", "run": {"name": "r"}, "train": train})
    finished = prechecks.check_resume(cfg, runrecord.run_folder(cfg))
    if hint is None:
        assert finished is None
    else:
        assert finished is not None and f"Nothing to train: {hint}, or start a new run" in finished.line, finished
