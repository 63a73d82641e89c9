"""A run whose global batch is held (`train.global_batch`) resumes on another world size at the
same sample: 2 ranks, then 1, then 2 again under torchrun, with a pipeline of the test's own that
writes down every sample index it trains on. Every epoch sees each sample exactly once, every
step the same number of samples, and the steps are the very ones an uninterrupted run takes."""

from __future__ import annotations

import json
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import TORCHRUN, cli_env, read_json

N, GLOBAL, MICRO = 40, 8, 2  # 5 steps an epoch; 2 micro-batches a step on 2 ranks, 4 on 1

PIPELINE = '''
import json, os
import torch
import raylane


class Model(raylane.Section):
    samples: int = 40


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self):
        return ("loss",)


class Recording(torch.nn.Module):
    """Writes the sample indices of each training micro-batch (its input is the index)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x):
        if self.training:
            with open(f"{os.environ['SEEN']}.{os.environ.get('RANK', '0')}", "a") as f:
                f.write(json.dumps([int(i) for i in x[:, 0].tolist()]) + "\\n")
        return self.linear(x)


def build(cfg):
    from torch.utils.data import TensorDataset
    from raylane.loop.pipeline import Pipeline

    n = cfg.model.samples
    x = torch.arange(n, dtype=torch.float32)[:, None]
    data = TensorDataset(x, x * 0.5)
    return Pipeline(model=Recording(), train_set=data, eval_set=TensorDataset(x[:8], x[:8] * 0.5),
                    loss_fn=torch.nn.functional.mse_loss,
                    eval_sums=lambda o, t: {"loss": torch.nn.functional.mse_loss(o, t, reduction="sum")})
'''


def _steps(seen: Path, world: int, first_step: int) -> dict[int, list[int]]:
    """step -> the samples of that step over all ranks, from each rank's micro-batches in order."""
    accum = GLOBAL // (MICRO * world)
    steps: dict[int, list[int]] = defaultdict(list)
    for rank in range(world):
        lines = Path(f"{seen}.{rank}").read_text().splitlines()
        for i, line in enumerate(lines):
            steps[first_step + i // accum].extend(json.loads(line))
    return dict(steps)


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "pipe.py").write_text(textwrap.dedent(PIPELINE))
    (tmp_path / "run.yaml").write_text(
        f"pipeline: ./pipe.py\nrun: {{name: elastic, storage_path: {tmp_path / 'runs'}}}\n"
        f"train: {{max_epochs: 3, batch_size: {MICRO}, global_batch: {GLOBAL}, global_batch_adjust: grad_accum_steps}}\n"
        "optim: {lr: 0.001}\nmlflow: {enabled: false}\n")
    return tmp_path


def _segment(run_cli, project: Path, world: int, limit: str, name: str, extra: tuple[str, ...] = ()) -> dict:
    env = cli_env(project, SEEN=str(project / name))
    p = run_cli(f"--nproc_per_node={world}", "-m", "raylane", "train", "run.yaml", "--set", limit, *extra,
                "--summary-json", str(project / f"{name}.json"), launcher=TORCHRUN, env=env, cwd=project, name=name)
    assert p.wait(180) == 0, p.output
    return read_json(project / f"{name}.json")


def test_resumes_2_to_1_to_2_ranks_see_every_sample_once_per_epoch(run_cli, project):
    a = _segment(run_cli, project, 2, "train.max_steps=3", "a")  # part-way through epoch 0
    # Another global batch cannot continue that epoch: refused before anything starts.
    p = run_cli("train", "run.yaml", "--local", "--set", "train.max_steps=6", "--set", "train.global_batch=4",
                cwd=project, name="changed")
    assert p.wait(60) == 2
    assert "train.global_batch = 4: run 'elastic' has a checkpoint part-way through an epoch saved with " \
           "train.global_batch = 8" in p.output and "Traceback" not in p.output
    b = _segment(run_cli, project, 1, "train.max_steps=7", "b")  # the rest of epoch 0, part of epoch 1
    c = _segment(run_cli, project, 2, "train.max_epochs=3", "c")  # to the end of epoch 2
    assert (a["steps"], b["steps"], c["steps"]) == (3, 7, 15) and b["resumed_from_step"] == 3
    steps = {**_steps(project / "a", 2, 1), **_steps(project / "b", 1, 4), **_steps(project / "c", 2, 8)}
    assert sorted(steps) == list(range(1, 16))
    assert all(len(samples) == GLOBAL for samples in steps.values())  # the global batch at every step
    for epoch in range(3):
        seen = [i for step in range(epoch * 5 + 1, epoch * 5 + 6) for i in steps[step]]
        assert sorted(seen) == list(range(N)), (epoch, seen)  # each sample exactly once

    # The same steps as a run on 2 ranks throughout: the order depends on the seed and epoch only.
    (project / "run.yaml").write_text((project / "run.yaml").read_text().replace("name: elastic", "name: straight"))
    _segment(run_cli, project, 2, "train.max_epochs=3", "straight")
    straight = _steps(project / "straight", 2, 1)
    assert {s: sorted(v) for s, v in straight.items()} == {s: sorted(v) for s, v in steps.items()}


def test_a_global_batch_the_workers_cannot_split_exits_2(run_cli, project):
    bad = run_cli("train", "run.yaml", "--local", "--set", "train.global_batch=7", cwd=project, name="indivisible")
    assert bad.wait(60) == 2
    assert "train.global_batch = 7: not a multiple of train.batch_size = 2 x scaling.num_workers = 1" in bad.output
    assert "Traceback" not in bad.output


def test_the_global_order_splits_each_step_and_resumes_at_any_world_size_and_micro_batch():
    from raylane.loop.data import GlobalOrderSampler

    def epoch(world: int, batch: int, skip_samples: int = 0) -> list[list[int]]:
        ranks = []
        for rank in range(world):
            s = GlobalOrderSampler(40, samples_per_step=8, batch_size=batch, rank=rank, world_size=world, seed=3)
            s.set_epoch(2, skip_batches=skip_samples // (batch * world))  # the Trainer's position, in micro-batches
            ranks.append(list(s))
        return ranks

    whole = epoch(2, 2)
    assert sorted(whole[0] + whole[1]) == list(range(40))  # every sample once
    steps = [sorted(whole[0][4 * k:4 * k + 4] + whole[1][4 * k:4 * k + 4]) for k in range(5)]
    # Two steps in, on 1 rank with micro-batches of 4, then on 4 ranks with 1: the same steps.
    for world, batch in ((1, 4), (4, 1), (2, 4)):
        rest = epoch(world, batch, skip_samples=16)
        per_rank = 8 // world
        assert [sorted(i for r in rest for i in r[per_rank * k:per_rank * (k + 1)]) for k in range(3)] == steps[2:]
    with pytest.raises(ValueError, match="train.global_batch = 64: more than the 40 training samples"):
        GlobalOrderSampler(40, samples_per_step=64, batch_size=8, rank=0, world_size=2, seed=0)
