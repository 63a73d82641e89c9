"""The training data changed between two launches of one run (issue 60, finding 14): rows
appended, a file deleted. Every checkpoint records the data's fingerprint (raylane.loop.data.loader.
fingerprint: a map-style dataset's length, a file stream's rows per file); a resume on data whose
fingerprint differs says so in one line and starts the epoch in progress over from its first
batch (the weights, optimizer, schedule and step go on), as a resume at another world size does.
Before, it resumed silently at the checkpoint's batch of an epoch of another length. In one
process, through `build_trainer` as tests/unit/test_trainer.py builds it; the CLI's own (a CSV
stream grown and shrunk under the tabular pipeline) is tests/e2e/test_resume.py's."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import raylane
from raylane.config import validate
from raylane.loop import checkpoint
from raylane.loop.data.loader import data_change, fingerprint
from raylane.loop.run import build_trainer, local_runtime, seed_everything


def _data(rows: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 4, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def _trainer(root: Path, name: str, rows: int):
    cfg = validate(
        {
            "pipeline": "regression",
            "run": {"name": name, "storage_path": str(root)},
            "train": {"batch_size": 8, "max_epochs": 2},
            "optim": {"name": "sgd", "lr": 0.05},
            "checkpoint": {"keep": None, "every_n_steps": 4},
            "mlflow": {"enabled": False},
        }
    )
    seed_everything(cfg.train.seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    pipe = raylane.Pipeline(model=model, train_set=_data(rows), loss_fn=torch.nn.functional.mse_loss)
    return build_trainer(cfg, local_runtime(cfg, lambda event: None), pipe)


def _stopped_at_4(tmp_path: Path, name: str) -> None:
    """A run of 48 rows (6 steps an epoch) whose only checkpoint is step 4's, mid-epoch."""
    _trainer(tmp_path, "straight", 48).train()
    (tmp_path / name).mkdir()
    shutil.copytree(
        tmp_path / "straight" / checkpoint.checkpoint_name(4), tmp_path / name / checkpoint.checkpoint_name(4)
    )


# Planted: Trainer.load_state_dict without the data check (the resume went on at batch 4 of an
# epoch of 12 batches, total 4 + 8 + 12 = 24 steps, and said nothing).
@pytest.mark.parametrize(("rows", "total"), [(96, 4 + 12 + 12), (24, 4 + 3 + 3)], ids=["appended", "deleted"])
def test_a_resume_on_changed_data_says_so_and_starts_the_epoch_over(tmp_path, caplog, rows, total):
    _stopped_at_4(tmp_path, "changed")
    with caplog.at_level(logging.WARNING, logger="raylane"):
        trainer = _trainer(tmp_path, "changed", rows)
    assert (trainer.step, trainer.epoch, trainer.batch_in_epoch, trainer.samples_seen_in_epoch) == (4, 0, 0, 0)
    assert trainer.total_steps == total
    lines = [r.getMessage() for r in caplog.records if "training data" in r.getMessage()]
    assert lines == [
        f"the training data changed since the checkpoint of step 4 (48 samples then, {rows} now): "
        "epoch 1 starts over on it from its first batch; the weights, optimizer and step go on"
    ]
    result = trainer.train()
    assert result.steps == total and result.resumed_from_step == 4
    saved = checkpoint.read_manifest(result.checkpoint)["train_state"]["data"]
    assert saved == {"samples": rows}  # the data the run trained on since


def test_a_resume_on_the_same_data_goes_on_at_its_batch_and_says_nothing(tmp_path, caplog):
    _stopped_at_4(tmp_path, "same")
    with caplog.at_level(logging.WARNING, logger="raylane"):
        trainer = _trainer(tmp_path, "same", 48)
    assert (trainer.step, trainer.batch_in_epoch, trainer.total_steps) == (4, 4, 12)
    assert not [r for r in caplog.records if "training data" in r.getMessage()]


def test_the_fingerprint_of_a_file_stream_and_the_line_of_each_change():
    class Stream:  # raylane.loop.data.streaming.FileStream's rows per piece (file or Parquet row group)
        def __init__(self, rows: list[int]) -> None:
            self.rows = rows

    before = fingerprint(Stream([10, 20]))
    assert before is not None and (before["samples"], before["pieces"]) == (30, 2)

    def line(rows: list[int], mid_epoch: bool = True) -> str | None:
        return data_change(before, fingerprint(Stream(rows)), step=7, epoch=2, mid_epoch=mid_epoch)

    assert line([10, 20]) is None
    head = "the training data changed since the checkpoint of step 7"
    assert line([10, 25]) == (
        f"{head} (30 samples then, 35 now): epoch 3 starts over on it from its first batch; "
        "the weights, optimizer and step go on"
    )
    assert (
        line([10, 15, 5], mid_epoch=False)
        == f"{head} (2 files or row groups then, 3 now): epoch 3 reads it as it is now"
    )
    # The same rows split otherwise: each rank's share of the epoch differs.
    assert line([20, 10]) is not None and "(30 samples then and now, in files of other lengths)" in line([20, 10])
    assert data_change(None, before, step=7, epoch=2, mid_epoch=True) is None  # a checkpoint from before fingerprints
    assert fingerprint(object()) is None
