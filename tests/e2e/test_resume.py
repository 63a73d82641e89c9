"""What a failing run keeps and what a resume says: an evaluation that raises at an epoch end
loses no step (the epoch is saved first); a resume that passes over a damaged checkpoint names it
and why, and does not log the retrained steps a second time in MLflow; a failed run's summary
names its newest valid checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from raylane.loop import checkpoint
from tests.conftest import REPO, cli_env, read_json

HELPER = REPO / "tests" / "helpers" / "shared_weights.py"


@pytest.mark.untracked
def test_an_evaluation_that_raises_at_an_epoch_end_loses_no_step(run_cli, tmp_path):
    """4 steps an epoch; eval_sums raises at the 2nd epoch end. Before, the epoch's checkpoint
    came after the evaluation: the run's newest was step 4, and steps 5-8 were lost."""
    shutil.copy(HELPER, tmp_path / "pipe.py")
    (tmp_path / "cfg.yaml").write_text("pipeline: ./pipe.py\ntrain: {batch_size: 16, max_epochs: 3}\n")
    args = ["train", "cfg.yaml", "--local", "--set", "run.name=ev"]
    failed = run_cli(*args, "--summary-json", "a.json", env=cli_env(tmp_path, EVAL_BREAKS_AT="2"), name="failed")
    assert failed.wait(120) == 1, failed.output
    a = read_json(tmp_path / "a.json")
    error = f"pipeline {str(tmp_path / 'pipe.py')!r}: eval_sums(output, target) raised ValueError: a bad held-out row"
    assert a["status"] == "FAILED" and a["error"].startswith(error), a
    assert [line for line in failed.output.splitlines() if "a bad held-out row" in line] == [
        f"  error:         {a['error']}"
    ], failed.output  # one line, no traceback
    newest = checkpoint.latest_valid(str(tmp_path / "runs" / "ev"))
    assert newest.endswith(checkpoint.checkpoint_name(8)) and a["checkpoint"] == newest
    state = checkpoint.read_manifest(newest)["train_state"]
    assert (state["epoch"], state["batch_in_epoch"], state["eval_metrics"]) == (2, 0, None)

    fixed = run_cli(*args, "--summary-json", "b.json", name="fixed")
    assert fixed.wait(120) == 0, fixed.output
    b = read_json(tmp_path / "b.json")
    assert b["resumed_from_step"] == 8 and b["steps"] == 12 and b["metrics"]["loss"] > 0, b


EVAL_ON_ONE_RANK = textwrap.dedent("""
    import datetime, json, os, sys
    import torch, torch.distributed as dist
    from raylane.loop.evaluation import Evaluator

    rank, init = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))

    def sums(output, target):
        if rank == 1 and len(outcomes) == 1:  # the 2nd evaluation, on rank 1 only
            raise ValueError("a bad held-out row")
        return {"loss": ((output - target) ** 2).sum()}

    data = [(torch.ones(4, 1), torch.zeros(4, 1))] * 3
    evaluate = Evaluator(data, sums, torch.device("cpu"), 2)
    outcomes = []
    for _ in range(3):
        try:
            outcomes.append(evaluate(torch.nn.Linear(1, 1)))
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    print(json.dumps(outcomes[1:]), flush=True)
    dist.destroy_process_group()
    os._exit(0)
""")


def test_an_evaluation_that_raises_on_one_rank_fails_on_every_rank(tmp_path):
    """The others would wait in the evaluation's reduction (until dist.timeout_s), and the save
    that follows a failed evaluation is collective: every rank learns of it in that reduction,
    and the next evaluation works again."""
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", EVAL_ON_ONE_RANK, str(rank), init],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    zero, one = (json.loads(out.strip().splitlines()[-1]) for out, _ in outs)
    assert zero[0] == "EvaluationFailed: the evaluation failed on rank 1: ValueError: a bad held-out row"
    assert one[0] == "ValueError: a bad held-out row"
    assert isinstance(zero[1], dict) and zero[1] == one[1]


def _mlflow_steps(db: Path, run_id: str) -> dict[str, list[int]]:
    import sqlite3

    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT key, step FROM metrics WHERE run_uuid = ? AND key NOT LIKE 'system/%' ORDER BY step", (run_id,)
        ).fetchall()
    steps: dict[str, list[int]] = {}
    for key, step in rows:
        steps.setdefault(key, []).append(step)
    return steps


def test_a_resume_past_a_damaged_checkpoint_says_so_and_logs_no_step_twice(run_cli, tmp_path):
    """The newest checkpoint's manifest is gone (an unfinished save): the relaunch resumes from
    the one before, says which it skipped and why, once, and lists it in the summary; the steps
    it trains again (31-40) are not logged a second time in the same MLflow run. Before, nothing
    was said, and train/* and checkpoint/step had two points at steps 40."""
    args = [
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=d",
        "--set",
        "checkpoint.every_n_steps=10",
        "--set",
        "mlflow.system_metrics=false",
        "--set",
        "mlflow.log_model=false",
    ]
    first = run_cli(*args, "--set", "train.max_steps=40", "--summary-json", "a.json", name="first")
    assert first.wait(120) == 0, first.output
    newest = Path(read_json(tmp_path / "a.json")["checkpoint"])
    assert newest.name == checkpoint.checkpoint_name(40)
    (newest / checkpoint.MANIFEST_FILE).unlink()

    again = run_cli(*args, "--set", "train.max_steps=50", "--summary-json", "b.json", name="again")
    assert again.wait(120) == 0, again.output
    b = read_json(tmp_path / "b.json")
    assert b["resumed_from_step"] == 30 and b["steps"] == 50
    line = "checkpoint_000000040 skipped: no manifest.json (an unfinished save); resuming from checkpoint_000000030"
    assert again.output.count(line) == 1, again.output
    assert b["skipped_checkpoints"] == [{"path": str(newest), "reason": "no manifest.json (an unfinished save)"}]
    steps = _mlflow_steps(tmp_path / "mlflow.db", b["run_id"])
    assert steps["train/loss"] == [10, 20, 30, 40, 50] and steps["checkpoint/step"] == [10, 20, 30, 40, 50], steps
    assert all(len(s) == len(set(s)) for s in steps.values()), steps


@pytest.mark.untracked
def test_a_failed_run_names_its_newest_valid_checkpoint(run_cli, tmp_path):
    """A non-finite loss at step 7 stops the run (train.on_nan: stop) while the save of step 6
    is in flight: it commits, and the summary names it. Before, it named step 4's."""
    p = run_cli(
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=nan",
        "--set",
        "train.on_nan=stop",
        "--set",
        "checkpoint.every_n_steps=2",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, RAYLANE_FAULTS="nan@step=7"),
    )
    assert p.wait(120) == 1, p.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FAILED"
    assert s["error"] == "FloatingPointError: non-finite loss or gradients at step 7 (train.on_nan: stop)", s
    assert s["checkpoint"] == str(tmp_path / "runs" / "nan" / checkpoint.checkpoint_name(6)), s
    assert checkpoint.verify(s["checkpoint"]) is None


def _csv(path: Path, rows: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    lines = ["x0,x1,label"]
    for _ in range(rows):
        x0, x1 = rng.uniform(-1, 1), rng.uniform(-1, 1)
        lines.append(f"{x0:.4f},{x1:.4f},{int(x0 + x1 > 0)}")
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.untracked
def test_a_resume_on_changed_data_starts_the_epoch_over_and_says_so(run_cli, tmp_path):
    """Issue 60, finding 14: rows appended to a run's CSV files between two launches (19 steps an
    epoch, then 38), then a file deleted (19 again). Each relaunch says in one line what changed
    since its checkpoint and starts the epoch in progress over on the data as it is (the rule of
    docs/training.md, Resume); before, it went on silently at the checkpoint's batch of an epoch
    of another length. The checkpoints record the data they were trained on."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        _csv(data / f"part{i}.csv", 152, seed=i)  # 304 rows, 19 steps of 16
    args = [
        "train",
        "tabular",
        "--local",
        "--set",
        "run.name=grown",
        "--set",
        "data.train=data",
        "--set",
        "data.format=csv",
    ]
    args += ["--set", "data.features=[x0,x1]", "--set", "data.eval=null", "--set", "train.batch_size=16"]
    args += ["--set", "checkpoint.every_n_steps=5", "--set", "train.max_epochs=null"]

    def launch(steps: int, name: str) -> tuple[dict, list[str]]:
        p = run_cli(*args, "--set", f"train.max_steps={steps}", "--summary-json", f"{name}.json", name=name)
        assert p.wait(120) == 0, p.output
        lines = [line for line in p.output.splitlines() if "training data" in line]
        return checkpoint.read_manifest(read_json(tmp_path / f"{name}.json")["checkpoint"])["train_state"], lines

    state, lines = launch(10, "first")
    assert (state["step"], state["batch_in_epoch"], state["data"]["samples"], lines) == (10, 10, 304, [])
    for i in range(2):  # as many rows again in each file
        with open(data / f"part{i}.csv", "a") as f:
            f.write("".join((data / f"part{i}.csv").read_text().splitlines(keepends=True)[1:]))
    state, lines = launch(30, "grown")
    assert lines == [
        "the training data changed since the checkpoint of step 10 (304 samples then, 608 now): epoch 1 "
        "starts over on it from its first batch; the weights, optimizer and step go on"
    ]
    assert (state["step"], state["epoch"], state["batch_in_epoch"], state["data"]["samples"]) == (30, 0, 20, 608)
    (data / "part1.csv").unlink()
    state, lines = launch(40, "shrunk")
    assert lines == [
        "the training data changed since the checkpoint of step 30 (608 samples then, 304 now): epoch 1 "
        "starts over on it from its first batch; the weights, optimizer and step go on"
    ]
    assert (state["step"], state["epoch"], state["batch_in_epoch"], state["data"]["samples"]) == (40, 0, 10, 304)
