"""SIGTERM or Ctrl-C to `raylane tune` on an embedded cluster (issue 60): the sweep's driver stops
its running trials at their ranks' next step boundary, closes every MLflow run of the sweep
KILLED (the trials' and the parent's), says so in one line, exits 130, and leaves no process of
its cluster behind; rerun, the same command continues the sweep.

Before (seen with the old code, this sweep): SIGTERM printed Ray's C++ '*** SIGTERM received'
and the driver aborted 3 s later (exit 134: the handler Ray installs for SIGTERM arms a 3 s alarm
that aborts), both trial runs left RUNNING and the parent KILLED; Ctrl-C ended Tune's loop as if
the sweep had finished: exit 0, the parent run and the sweep's record FINISHED, both trial runs
RUNNING, and a rerun found the sweep finished."""

from __future__ import annotations

import json
import signal
import sqlite3

import pytest

from tests.conftest import cli_env, read_json, wait_for

SLOW = "slow@ms=200"  # every step: a trial on one worker trains for about 9 s an epoch
STEPS_PER_EPOCH = 45  # digits on one worker of batch 32

SETS = {
    "sweep.scheduler": "fifo",
    "train.max_epochs": "4",
    "scaling.num_workers": "1",
    "mlflow.log_every_n_steps": "2",
    "run.storage_path": "runs",
}


def _args(name: str, trials: int) -> list[str]:
    sets = {**SETS, "sweep.name": name, "sweep.num_samples": str(trials), "sweep.max_concurrent_trials": str(trials)}
    return ["tune", "digits-sweep", *[x for k, v in sets.items() for x in ("--set", f"{k}={v}")]]


def _query(db, sql: str, *args) -> list[tuple]:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as con:
            return con.execute(sql, args).fetchall()
    except sqlite3.Error:  # not laid out yet, or busy
        return []


def _trials(db) -> list[tuple[str, str]]:
    """(run id, status) of every trial's run."""
    return _query(
        db,
        "SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
        "WHERE t.key = 'mlflow.parentRunId'",
    )


def _training(db) -> int:
    """How many trials' rank 0 has sent a training loss."""
    return len(
        _query(
            db,
            "SELECT DISTINCT m.run_uuid FROM metrics m JOIN tags t ON t.run_uuid = m.run_uuid "
            "WHERE t.key = 'mlflow.parentRunId' AND m.key = 'train/loss'",
        )
    )


def _every_run(db) -> dict[str, tuple[str, str | None]]:
    """Every run of the database: run id -> (status, its raylane.error tag)."""
    rows = _query(
        db,
        "SELECT r.run_uuid, r.status, t.value FROM runs r "
        "LEFT JOIN tags t ON t.run_uuid = r.run_uuid AND t.key = 'raylane.error'",
    )
    return {run_id: (status, error) for run_id, status, error in rows}


def _interrupted(sweep, tmp_path, name: str, checkpointed: str | None) -> str:
    """What every interrupted sweep leaves: exit 130, one line, every run closed KILLED with why,
    its summary and record KILLED, and nothing of its cluster running; returns the parent run.
    `checkpointed`: what the line says of the trials that stopped with a checkpoint (None: not
    checked)."""
    assert sweep.wait(120) == 130, sweep.output
    s = read_json(tmp_path / "s.json")
    assert (s["status"], s["sweep"]) == ("KILLED", name), s
    runs = _every_run(tmp_path / "mlflow.db")
    line = s["error"]
    assert runs.pop(s["parent_run_id"]) == ("KILLED", line)
    assert runs and runs == {run_id: ("KILLED", "interrupted") for run_id in runs}, runs
    trials = f"{len(runs)} running trial{'s' if len(runs) > 1 else ''}"
    said = f"interrupted: sweep {name} stopped; the MLflow runs of its {trials} and its parent run closed KILLED"
    assert line.startswith(said) and line.endswith("; rerun the same command to continue the sweep"), line
    assert checkpointed is None or line == f"{said}{checkpointed}; rerun the same command to continue the sweep"
    # The terminal: raylane's own lines only (before, Ray's '*** SIGTERM received' and an abort).
    shown = [x for x in sweep.output.splitlines() if x.strip()]
    assert shown[0].startswith(f"[raylane] sweep {name}: ") and shown[1] == f"raylane: {line}", shown
    assert all(x.startswith("[raylane] library log: ") for x in shown[2:]), shown
    assert json.loads((tmp_path / "runs" / name / "raylane_sweep.json").read_text())["status"] == "KILLED"
    assert wait_for(lambda: not sweep.session_pids(), 15)  # the embedded cluster went with the driver
    return s["parent_run_id"]


def test_sigterm_while_a_trial_trains_closes_every_run_of_the_sweep_killed(run_cli, tmp_path):
    """One trial (~80 CPU-s to the signal: Ray's start and the trial's); two, and Ctrl-C: below."""
    db = tmp_path / "mlflow.db"
    sweep = run_cli(*_args("sigterm", 1), "--summary-json", "s.json", env=cli_env(tmp_path, RAYLANE_FAULTS=SLOW))
    wait_for(lambda: _training(db) == 1 or sweep.proc.poll() is not None, timeout_s=400)
    assert sweep.proc.poll() is None, sweep.output
    sweep.signal(signal.SIGTERM)
    _interrupted(sweep, tmp_path, "sigterm", ", 1 checkpointed where it stopped")
    # Its ranks stopped at a step boundary with a checkpoint, within its first of 4 epochs.
    (folder,) = (tmp_path / "runs").glob("sigterm-*")
    (checkpoint,) = folder.glob("checkpoint_*")
    assert 0 < int(checkpoint.name.rsplit("_", 1)[1]) < STEPS_PER_EPOCH * 4, checkpoint


@pytest.mark.slow  # two trials, interrupted, then run again to their end: ~4 minutes on 2 busy cores
def test_ctrl_c_while_trials_start_then_the_same_command_continues_the_sweep(run_cli, tmp_path):
    """Ctrl-C as the first of two trials opens its run (its ranks not started yet): a trial that
    opens its run after the signal is closed too, once Ray has stopped. Run again, the sweep
    continues under the same parent and ends FINISHED, its trials' runs too, with no 'interrupted'
    left on any of them."""
    db = tmp_path / "mlflow.db"
    env = cli_env(tmp_path, RAYLANE_FAULTS=SLOW)
    args = [*_args("ctrl-c", 2), "--set", "train.max_epochs=1"]
    sweep = run_cli(*args, "--summary-json", "s.json", env=env)
    wait_for(lambda: _trials(db) or sweep.proc.poll() is not None, timeout_s=400)
    assert sweep.proc.poll() is None, sweep.output
    sweep.signal(signal.SIGINT)
    parent = _interrupted(sweep, tmp_path, "ctrl-c", None)

    again = run_cli(*args, "--summary-json", "again.json", env=env, name="again")
    assert again.wait(600) == 0, again.output
    s = read_json(tmp_path / "again.json")
    assert s["status"] == "FINISHED" and s["parent_run_id"] == parent, s
    assert {r["status"] for r in s["trials"]} == {"FINISHED"}, s["trials"]
    finished = _every_run(db)
    assert finished[parent] == ("FINISHED", None)
    assert all(finished[r["run_id"]] == ("FINISHED", None) for r in s["trials"]), finished
    assert "RUNNING" not in {status for status, _ in finished.values()}, finished
