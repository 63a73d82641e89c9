"""Held-out shares of unequal size under FSDP, whose forward gathers parameters from every rank:
a rank with no held-out batch at all still joins each forward (another rank's first batch,
uncounted), so the evaluation neither hangs nor fails, and its metrics are those of the ranks
with data. Before, that rank left for the next vote while the others ran a forward whose
all-gathers it never joined: gloo's "Application timeout caused pair closure" after
dist.timeout_s (300 s by default)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO, TORCHRUN, read_json

# Two ranks, each its own process, evaluating a model sharded with FSDP2 over gloo: rank 1 has
# no held-out batch (then rank 0 none), while the other has two of unequal size.
EVALUATE = textwrap.dedent("""
    import datetime, json, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from raylane.loop.evaluation import Evaluator

    rank, init = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    with torch.no_grad():
        expected = ((model(x) - y) ** 2).sum().item() / 5  # the mean over every held-out row, unsharded
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    batches = [(x[:3], y[:3]), (x[3:], y[3:])]

    def sums(output, target):
        return {"loss": ((output - target) ** 2).sum(), "rows": torch.tensor(float(len(target)))}

    results = []
    for empty in (1, 0):  # the rank without data
        data = [] if rank == empty else batches
        results.append(Evaluator(data, sums, torch.device("cpu"), 2)(model))
    print(json.dumps({"expected": expected, "results": results}), flush=True)
    dist.destroy_process_group()
    os._exit(0)
""")


def test_a_rank_with_no_held_out_batch_joins_fsdp_forwards(tmp_path):
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", EVALUATE, str(rank), init],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    zero, one = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert zero["results"] == one["results"]
    for metrics in zero["results"]:
        assert metrics["rows"] == 1.0  # 5 rows counted once each: the lent batch is not counted
        assert metrics["loss"] == pytest.approx(zero["expected"], rel=1e-6)


PIPELINE = """
import raylane
import torch
from torch.utils.data import TensorDataset


class DataSection(raylane.Section):
    eval: raylane.InputPath


class Config(raylane.BaseConfig):
    data: DataSection


def build(cfg):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(16, 2)

    def to_tensors(batch):
        return torch.tensor(batch["x"], dtype=torch.float32)[:, None].expand(-1, 2), torch.tensor(batch["y"])[:, None]

    def eval_sums(output, target):
        return {"target": target.sum(), "rows": torch.tensor(float(len(target)))}

    held_out = raylane.FileSource(paths=cfg.data.eval, format="csv", to_tensors=to_tensors, key="data.eval")
    return raylane.Pipeline(model=model, train_set=TensorDataset(x, x.sum(1, keepdim=True)), eval_set=held_out,
                            loss_fn=torch.nn.functional.mse_loss, eval_sums=eval_sums)
"""


@pytest.mark.untracked
def test_fsdp_under_torchrun_evaluates_one_held_out_file_on_two_ranks(run_cli, tmp_path):
    """The newcomer's case: one held-out file for two ranks under FSDP. It evaluates: the
    metrics are the file's rows, each counted once (before: a 300 s hang, then a gloo error)."""
    (tmp_path / "pipe.py").write_text(PIPELINE)
    (tmp_path / "eval.csv").write_text("x,y\n" + "".join(f"{i / 10},{float(i)}\n" for i in range(5)))
    (tmp_path / "cfg.yaml").write_text("pipeline: ./pipe.py\ndata: {eval: eval.csv}\ntrain: {batch_size: 4}\n")
    p = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        "train",
        "cfg.yaml",
        "--set",
        "strategy.name=fsdp",
        "--summary-json",
        "s.json",
        launcher=TORCHRUN,
    )
    assert p.wait(120) == 0, p.output  # dist.timeout_s is 300 s: a hang ends the test here
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["strategy"] == "fsdp" and s["world_size"] == 2
    assert s["metrics"] == {"target": pytest.approx(2.0), "rows": 1.0}, s["metrics"]  # the mean of 0..4
