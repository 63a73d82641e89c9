"""The end of a run is no collective: work rank 0 alone does after the last step (the MLflow
model, built again from the pipeline and the last checkpoint) never turns a finished training
into a failure. Before, the other ranks waited for rank 0 in a barrier at the exit, bounded by
dist.timeout_s: a tiny Mixtral's MLflow model outlasted it, and the run ended FAILED."""

from __future__ import annotations

import pytest

from tests.conftest import TORCHRUN, read_json

TIMEOUT_S = 10

# The model's build sleeps past dist.timeout_s when rank 0 builds it again for the MLflow model
# at the end (a checkpoint exists by then): a slow end-of-run of rank 0's alone. At the start,
# rank 0 builds once its MLflow run is open (seconds: a database to create), and rank 1 waits for
# that in its own build, so that the start's collectives do not wait that long on this short a
# timeout.
PIPELINE = f"""
import os
import pathlib
import time

import raylane
import torch
from torch.utils.data import TensorDataset


class Config(raylane.BaseConfig):
    pass


def build(cfg):
    run = pathlib.Path(cfg.run.storage_path) / cfg.run.name
    started = run / "rank-0-built"
    if os.environ.get("RANK") == "0":
        if any(run.glob("checkpoint_*/manifest.json")):
            time.sleep({TIMEOUT_S} + 5)
        run.mkdir(parents=True, exist_ok=True)
        started.touch()
    else:
        deadline = time.time() + 120
        while not started.exists() and time.time() < deadline:
            time.sleep(0.1)
    torch.manual_seed(0)
    x = torch.randn(16, 2)
    return raylane.Pipeline(model=torch.nn.Linear(2, 1), train_set=TensorDataset(x, x.sum(1, keepdim=True)),
                            eval_set=None, loss_fn=torch.nn.functional.mse_loss)
"""


@pytest.mark.slow  # ~20 s: dist.timeout_s waited out under torchrun (make test runs every other end of a run)
def test_rank_zero_end_of_run_work_longer_than_the_timeout_still_finishes(run_cli, tmp_path):
    (tmp_path / "pipe.py").write_text(PIPELINE)
    (tmp_path / "cfg.yaml").write_text(
        f"pipeline: ./pipe.py\ntrain: {{batch_size: 4}}\ndist: {{timeout_s: {TIMEOUT_S}}}\n"
    )
    p = run_cli(
        "--nproc_per_node", "2", "-m", "raylane", "train", "cfg.yaml", "--summary-json", "s.json", launcher=TORCHRUN
    )
    assert p.wait(150) == 0, p.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["world_size"] == 2 and s["steps"] == 2, s
    assert s["model_uri"], s  # the slow work was done: rank 0 logged the model
