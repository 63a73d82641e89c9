"""Nothing recorded is overwritten or downgraded (issue 21): a finished run relaunched trains and
logs nothing, a run relaunched with a model its checkpoint cannot fit is refused before anything
starts, a longer schedule continues the run and, if it fails, leaves the finished MLflow run
FINISHED. (A sweep rerun with changed settings is refused and leaves every file of the earlier
sweep byte-identical: tests/e2e/test_tune.py checks it on the sweep its resume test finishes.)

One real run makes the records once; the relaunches that must not start anything run in this
process through `raylane.cli.main`, with what would start work replaced by a failure."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
from pathlib import Path

import pytest
import torch

from raylane import cli, prechecks, runrecord
from raylane.config import load_config
from raylane.loop import checkpoint
from tests.conftest import RAYLANE, cli_env, read_json

RUN = [
    "--set",
    "run.name=r",
    "--set",
    "scaling.num_workers=1",
    "--set",
    "mlflow.system_metrics=false",
    "--set",
    "mlflow.log_model=false",
]


def _hashes(root: Path) -> dict[str, str]:
    """Every file under `root` but the test's own logs: the run's folder, MLflow's database and
    artifacts."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix != ".log"
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A digits run of 3 steps, FINISHED, tracked in MLflow (sqlite) with its model logged."""
    root = tmp_path_factory.mktemp("finished")
    out = subprocess.run(
        [*RAYLANE, "train", "digits", "--local", *RUN, "--set", "train.max_steps=3", "--summary-json", "a.json"],
        cwd=root,
        env=cli_env(root),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (root / "runs/r" / runrecord.RUN_RECORD).is_file()
    return root


def _status(root: Path, run_id: str) -> str:
    with sqlite3.connect(root / "mlflow.db") as con:
        return con.execute("SELECT status FROM runs WHERE run_uuid = ?", (run_id,)).fetchone()[0]


def test_a_finished_run_relaunched_trains_and_logs_nothing(finished, monkeypatch, capsys, no_work):
    a = read_json(finished / "a.json")
    before = _hashes(finished)
    monkeypatch.chdir(finished)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{finished / 'mlflow.db'}")
    assert cli.main(["train", "digits", "--local", *RUN, "--set", "train.max_steps=3"]) == 0
    out, err = capsys.readouterr()
    assert out == (
        f"run r: already FINISHED at step 3 (epoch 0); checkpoint {a['checkpoint']}; MLflow run "
        f"{a['run_id']}. Nothing to train: raise train.max_steps to train it "
        "further, or start a new run with --set run.name=r-2\n"
    ), out + err
    # The API too: it hands back the summary the run finished with.
    from raylane.api import train as run_training

    again = run_training("digits", [*RUN[1::2], "train.max_steps=3"], local=True)
    assert again.already_finished and again.run_id == a["run_id"] and again.steps == 3
    assert _hashes(finished) == before  # not one byte of the run, its database or its model


def test_the_finished_run_has_its_params_and_metrics_in_mlflow(finished):
    """A run in one process (`--local`) records its config as params, and its training and
    held-out metrics (over 3 steps: those of its last step)."""
    run_id = read_json(finished / "a.json")["run_id"]
    with sqlite3.connect(finished / "mlflow.db") as con:
        params = dict(con.execute("SELECT key, value FROM params WHERE run_uuid = ?", (run_id,)))
        keys = {key for (key,) in con.execute("SELECT DISTINCT key FROM metrics WHERE run_uuid = ?", (run_id,))}
    assert params["model.hidden_size"] == "128" and params["train.max_steps"] == "3"
    assert keys >= {"train/loss", "train/lr", "train/samples_per_s", "eval/loss", "eval/accuracy"}, keys
    assert _status(finished, run_id) == "FINISHED"


def test_a_changed_model_is_refused_before_anything_starts(finished, monkeypatch, capsys, no_work):
    before = _hashes(finished)
    monkeypatch.chdir(finished)
    assert cli.main(["train", "digits", *RUN, "--set", "model.hidden_size=64"]) == 2
    out, err = capsys.readouterr()
    line = (
        f"raylane: model.hidden_size = 64: run 'r' has a checkpoint saved with model.hidden_size = 128 "
        f"('{finished}/runs/r/{checkpoint.checkpoint_name(3)}') that this config cannot load; keep "
        "model.hidden_size=128 to resume it, or start a fresh run with --set run.name=r-2"
    )
    assert out == "" and err.splitlines() == [line]
    assert _hashes(finished) == before
    assert _status(finished, read_json(finished / "a.json")["run_id"]) == "FINISHED"


def test_a_longer_schedule_continues_and_its_failure_keeps_the_run_finished(finished):
    """Runs last in this module: it adds steps to the run."""
    a = read_json(finished / "a.json")
    record = (finished / "runs/r" / runrecord.RUN_RECORD).read_bytes()
    out = subprocess.run(
        [*RAYLANE, "train", "digits", "--local", *RUN, "--set", "train.max_steps=6", "--summary-json", "b.json"],
        cwd=finished,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=cli_env(finished, RAYLANE_FAULTS="raise@step=5"),
    )
    assert out.returncode == 1, out.stdout + out.stderr
    b = read_json(finished / "b.json")
    assert b["status"] == "FAILED" and "injected failure" in b["error"] and b["run_id"] == a["run_id"], (
        out.stdout + out.stderr
    )
    assert "resumed from step 3" in out.stdout  # it did continue the run
    assert _status(finished, a["run_id"]) == "FINISHED"
    assert (finished / "runs/r" / runrecord.RUN_RECORD).read_bytes() == record


def test_what_may_change_on_resume():
    saved = ["optim.name=sgd", "optim.momentum=0.9", "optim.schedule=cosine"]

    def change(*sets: str) -> str | None:
        return prechecks.first_unloadable(
            load_config("digits", saved).flat(), load_config("digits", [*saved, *sets]).flat()
        )

    assert (
        change(
            "train.max_epochs=40",
            "train.max_steps=7",
            "scaling.num_workers=3",
            "optim.lr=0.5",
            "mlflow.enabled=false",
            "checkpoint.every_n_steps=5",
            "checkpoint.keep=1",
            "strategy.name=fsdp",
            "train.precision=bf16",
            "optim.momentum=0",
            "optim.schedule=constant",
            "train.batch_size=8",
        )
        is None
    )
    assert change("model.num_layers=3") == "model.num_layers"
    assert change("optim.name=adamw") == "optim.name"
    adam = load_config("digits", ["optim.name=adam"]).flat()
    assert prechecks.first_unloadable(adam, {**adam, "optim.name": "adamw"}) is None  # the same state


def test_a_manifest_records_shapes_and_another_model_is_refused_at_load(tmp_path):
    model = torch.nn.Linear(2, 3)
    path = tmp_path / checkpoint.checkpoint_name(1)
    path.mkdir()
    checkpoint.save(path, model, torch.optim.SGD(model.parameters(), lr=0.1), {"step": 1}, rank=0)
    assert checkpoint.read_manifest(path)["shapes"] == {"weight": [3, 2], "bias": [3]}
    wider = torch.nn.Linear(2, 4)
    with pytest.raises(checkpoint.CheckpointLoadError, match=r"bias is shape \[3\] there and shape \[4\] here"):
        checkpoint.load(path, wider, torch.optim.SGD(wider.parameters(), lr=0.1))
