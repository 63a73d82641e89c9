"""Streaming sources (raylane.loop.data.streaming.FileSource): on Ray through Ray Data split by Ray
Train, under torchrun and in one process read by each rank with pyarrow. A pipeline of the
test's own records which rows each rank trained on (its loss function writes the row ids of
every batch it is given) and which files each rank read (its transform, which runs where the
files are read, writes their ids)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import TORCHRUN, read_json

FILES, ROWS_PER_FILE, BATCH = 4, 24, 8

pytestmark = pytest.mark.untracked

PIPELINE = """
import os
import numpy as np
from pydantic import Field
import raylane


class DataSection(raylane.Section):
    train: str
    record: str


class Config(raylane.BaseConfig):
    data: DataSection


def _rank():
    import torch.distributed as dist
    return dist.get_rank() if dist.is_initialized() else 0


def sources(cfg):
    def transform(batch):
        # Where the files are read: the rank's reader thread (pyarrow) or a Ray Data task.
        who = os.environ.get("RANK", "task") if "RAY_RAYLET_PID" not in os.environ else "task"
        with open(os.path.join(cfg.data.record, f"read-{who}.txt"), "a") as f:
            f.write(",".join(str(i) for i in sorted(set(batch["file"].tolist()))) + "\\n")
        return batch

    def to_tensors(batch):
        import torch
        x = np.stack([batch["row"] / 100.0, batch["file"]], axis=1).astype(np.float32)
        return torch.tensor(x), torch.tensor(batch["row"], dtype=torch.float64)

    return {"train": raylane.FileSource(paths=cfg.data.train, columns=["row", "file"], transform=transform,
                                         to_tensors=to_tensors)}


def build(cfg):
    import torch

    def loss_fn(output, rows):
        with open(os.path.join(cfg.data.record, f"rows-{_rank()}.txt"), "a") as f:
            f.write(",".join(str(int(r)) for r in rows.tolist()) + "\\n")
        return torch.nn.functional.mse_loss(output.squeeze(-1), (rows / 1000).float())

    return raylane.Pipeline(model=torch.nn.Linear(2, 1), train_set=sources(cfg)["train"], eval_set=None,
                            loss_fn=loss_fn, eval_sums=lambda o, t: {})
"""


def _project(tmp_path: Path, record: str = "rec") -> list[str]:
    """The pipeline file, its data (FILES Parquet files, one row group each, row ids distinct
    across files) and its config; returns the --set arguments."""
    (tmp_path / "ids.py").write_text(PIPELINE)
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    for f in range(FILES):
        rows = np.arange(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE)
        pq.write_table(pa.table({"row": rows, "file": np.full(len(rows), f)}), data / f"part-{f}.parquet")
    (tmp_path / record).mkdir(exist_ok=True)
    return [
        "--set",
        f"data.train={data}",
        "--set",
        f"data.record={tmp_path / record}",
        "--set",
        f"train.batch_size={BATCH}",
        "--set",
        "mlflow.enabled=false",
        "--set",
        "optim.lr=0.01",
    ]


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "ids.yaml"
    path.write_text("pipeline: ./ids.py\n")
    return path


def _batches(path: Path) -> list[list[int]]:
    if not path.exists():
        return []
    return [[int(i) for i in line.split(",")] for line in path.read_text().split()]


def _rows(path: Path) -> list[int]:
    return [r for batch in _batches(path) for r in batch]


@pytest.mark.slow  # ~70 s; Ray Data streams on Ray in make test: test_paths, test_failures; stream resume: the torchrun tests here
@pytest.mark.ray
@pytest.mark.shared_ray
def test_ray_data_splits_rows_across_ranks_and_resumes_at_the_next_epoch(run_cli, tmp_path):
    """Ray Data streams the files through Ray Train's split: each epoch, the two ranks' rows are
    disjoint and together every row; a run resumed from an epoch-end checkpoint starts at the
    next epoch, which again sees every row exactly once."""
    args = [
        "train",
        str(_config(tmp_path)),
        *_project(tmp_path),
        "--set",
        "scaling.num_workers=2",
        "--set",
        "run.name=rd",
    ]
    first = run_cli(*args, "--set", "train.max_epochs=1", "--summary-json", "a.json")
    assert first.wait(300) == 0, first.output
    a = read_json(tmp_path / "a.json")
    every = set(range(FILES * ROWS_PER_FILE))
    per_epoch = FILES * ROWS_PER_FILE // 2 // BATCH  # the equal split: 48 rows a rank, 6 batches
    assert (a["status"], a["steps"], a["epochs"]) == ("FINISHED", per_epoch, 1)
    r0, r1 = _rows(tmp_path / "rec/rows-0.txt"), _rows(tmp_path / "rec/rows-1.txt")
    assert len(r0) == len(r1) == len(every) // 2 and not set(r0) & set(r1) and set(r0) | set(r1) == every
    # The preprocessing ran in Ray Data's tasks, not on the ranks.
    assert (tmp_path / "rec/read-task.txt").exists() and not list((tmp_path / "rec").glob("read-[01].txt"))

    (tmp_path / "rec2").mkdir()
    again = run_cli(
        *args[:-2],
        "--set",
        "run.name=rd",
        "--set",
        f"data.record={tmp_path / 'rec2'}",
        "--set",
        "train.max_epochs=2",
        "--summary-json",
        "b.json",
    )
    assert again.wait(300) == 0, again.output
    b = read_json(tmp_path / "b.json")
    assert (b["resumed_from_step"], b["steps"], b["epochs"]) == (per_epoch, 2 * per_epoch, 2)
    r0, r1 = _rows(tmp_path / "rec2/rows-0.txt"), _rows(tmp_path / "rec2/rows-1.txt")
    assert len(r0) + len(r1) == len(every) and set(r0) | set(r1) == every and not set(r0) & set(r1)


def test_torchrun_ranks_read_only_their_own_files(run_cli, tmp_path):
    """Each rank opens only the files dealt to it for the epoch (its transform, which sees every
    chunk it reads, saw no other file), trains on exactly their rows, and the deal changes with
    the epoch; both ranks run the same number of steps."""
    proc = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        "train",
        str(_config(tmp_path)),
        *_project(tmp_path),
        "--set",
        "run.name=tr",
        "--set",
        "train.max_epochs=2",
        "--summary-json",
        "s.json",
        launcher=TORCHRUN,
    )
    assert proc.wait(180) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    per_rank = FILES // 2 * ROWS_PER_FILE // BATCH
    assert (s["status"], s["world_size"], s["steps"]) == ("FINISHED", 2, 2 * per_rank)
    files_of_row = {r: r // ROWS_PER_FILE for r in range(FILES * ROWS_PER_FILE)}
    deals = []
    for epoch in range(2):
        read = [_batches(tmp_path / f"rec/read-{r}.txt")[2 * epoch : 2 * epoch + 2] for r in (0, 1)]
        opened = [{f for chunk in chunks for f in chunk} for chunks in read]
        assert all(len(o) == 2 for o in opened) and not opened[0] & opened[1]  # two whole files each
        for r in (0, 1):
            batches = _batches(tmp_path / f"rec/rows-{r}.txt")[epoch * per_rank : (epoch + 1) * per_rank]
            trained = {files_of_row[row] for b in batches for row in b}
            assert trained == opened[r] and sum(map(len, batches)) == 2 * ROWS_PER_FILE
        deals.append(opened)
    assert deals[0] != deals[1]  # dealt anew each epoch, from the seed


def test_mid_epoch_resume_replays_exactly_the_remaining_batches(run_cli, tmp_path):
    """pyarrow's stream depends only on (seed, epoch, rank, world size): a run stopped mid-epoch
    and resumed trains on exactly the batches an uninterrupted run trains on, in the same order,
    and ends with bit-identical weights."""
    args = [
        "train",
        str(_config(tmp_path)),
        "--local",
        "--set",
        "checkpoint.every_n_steps=5",
        "--set",
        "train.max_epochs=2",
    ]
    first = run_cli(
        *args,
        *_project(tmp_path, "cut"),
        "--set",
        "run.name=cut",
        "--set",
        "train.max_steps=5",
        "--summary-json",
        "a.json",
    )
    assert first.wait(120) == 0, first.output
    again = run_cli(*args, *_project(tmp_path, "cut"), "--set", "run.name=cut", "--summary-json", "b.json")
    straight = run_cli(*args, *_project(tmp_path, "whole"), "--set", "run.name=whole", "--summary-json", "c.json")
    assert again.wait(120) == 0, again.output
    assert straight.wait(120) == 0, straight.output
    b, c = read_json(tmp_path / "b.json"), read_json(tmp_path / "c.json")
    assert b["resumed_from_step"] == 5 and b["steps"] == c["steps"] == 2 * FILES * ROWS_PER_FILE // BATCH
    assert _batches(tmp_path / "cut/rows-0.txt") == _batches(tmp_path / "whole/rows-0.txt")

    import torch

    from raylane.loop import checkpoint

    weights = []
    for summary in (b, c):
        model = torch.nn.Linear(2, 1)
        checkpoint.load(summary["checkpoint"], model, torch.optim.SGD(model.parameters(), lr=0.01))
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])
