"""A resume on another batch size (or world size) goes on counting the epoch in samples: its
fraction never goes back, and the resume continues at the sample it stopped at. Two one-process
launches, in this process (`raylane.cli.main`, no MLflow)."""

from __future__ import annotations

import json

from raylane import cli
from raylane.loop import checkpoint
from tests.conftest import read_json

PIPELINE = """
import raylane
import torch
from torch.utils.data import TensorDataset


class Config(raylane.BaseConfig):
    pass


def build(cfg):
    torch.manual_seed(0)
    x = torch.randn(64, 2)
    return raylane.Pipeline(model=torch.nn.Linear(2, 1), train_set=TensorDataset(x, x.sum(1, keepdim=True)),
                            eval_set=None, loss_fn=torch.nn.functional.mse_loss)
"""


def test_the_epoch_fraction_counts_samples_across_a_batch_size_change(tmp_path, monkeypatch, capsys):
    """64 samples: 3 steps at batch 8 (24 samples, 0.375 epoch), then one at batch 4 (28 samples).
    Before, the fraction was the batch index over the new epoch's batches, 0.25 (its 4th batch of
    16), and the resume restarted at batch 3 of 4 samples: sample 12, though 24 had trained."""
    (tmp_path / "pipe.py").write_text(PIPELINE)
    (tmp_path / "cfg.yaml").write_text("pipeline: ./pipe.py\nrun: {name: r}\nmlflow: {enabled: false}\n")
    monkeypatch.chdir(tmp_path)
    args = ["train", "cfg.yaml", "--local", "--set", "checkpoint.every_n_steps=0"]
    assert (
        cli.main([*args, "--set", "train.batch_size=8", "--set", "train.max_steps=3", "--summary-json", "a.json"]) == 0
    )
    assert (
        cli.main([*args, "--set", "train.batch_size=4", "--set", "train.max_steps=4", "--summary-json", "b.json"]) == 0
    )
    out = capsys.readouterr().out
    a, b = read_json(tmp_path / "a.json"), read_json(tmp_path / "b.json")
    assert (a["steps"], a["partial_epoch"], b["steps"], b["partial_epoch"]) == (3, 0.375, 4, 0.4375), (a, b)
    assert "3 in 0.38 epoch" in out and "4 in 0.44 epoch" in out, out
    state = checkpoint.read_manifest(b["checkpoint"])["train_state"]
    assert (state["batch_in_epoch"], state["samples_seen_in_epoch"]) == (7, 28), json.dumps(state)[:400]
