"""Hangs diagnosed (issue 51, item 3), under torchrun on 2 CPU ranks (gloo): rank 1 hangs in the
user's own loss function. While it does, `raylane stacks` (another process's command, run here
in-process) prints both ranks' current stacks: rank 1 in the user's function, rank 0 waiting in
the gradient sync. Past `dist.timeout_s` the run fails with one line naming rank 1 and the user's
file:line, every rank's stack is in the run's `stacks/` folder and in MLflow, and the MLflow run
is closed. On Ray, the same failure: tests/e2e/test_preemption.py (a rank hung in raylane's own
fault hook; make test-all); the parsing and the line in-process: tests/unit/test_hangs.py."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3

import pytest

from raylane.cli import main
from tests.conftest import REPO, TORCHRUN, read_json, wait_for

HELPER = REPO / "tests" / "helpers" / "hang_pipe.py"
HANG_LINE = next(i for i, line in enumerate(HELPER.read_text().splitlines(), 1) if "# HANG" in line)


def test_a_hung_rank_is_named_where_it_stood_with_every_rank_stack(run_cli, tmp_path, capsys):
    shutil.copy(HELPER, tmp_path / "pipe.py")
    (tmp_path / "cfg.yaml").write_text("pipeline: ./pipe.py\n")
    runs, marker = tmp_path / "runs", tmp_path / "hanging"
    sets = {
        "run.name": "hung",
        "run.storage_path": str(runs),
        "dist.timeout_s": "10",
        "train.batch_size": "8",
        "mlflow.log_model": "false",
        "mlflow.system_metrics": "false",
        "model.hang_s": "600",
        "model.marker": str(marker),
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    p = run_cli(
        "--nproc_per_node", "2", "-m", "raylane", "train", "cfg.yaml", *args, "--summary-json", "s.json",
        launcher=TORCHRUN, cwd=tmp_path,
    )  # fmt: skip
    wait_for(lambda: marker.exists() or p.proc.poll() is not None, 120)
    assert p.proc.poll() is None, p.output

    # A live run: both ranks answer within seconds, rank 1 in the user's loss, rank 0 in the sync.
    assert main(["stacks", "hung", "--storage-path", str(runs)]) == 0
    out = capsys.readouterr().out
    host = socket.gethostname()
    pipe = tmp_path / "pipe.py"
    assert f"== rank 1 (pid {marker.read_text()}, {host}): running, at {pipe}:{HANG_LINE} in loss" in out, out
    assert "== rank 0 (pid " in out and f"{host}): waiting in a collective" in out, out
    assert f'File "{pipe}", line {HANG_LINE} in loss' in out

    # Past the bound: FAILED, one line naming rank 1 and where it stood. Rank 1 sleeps on (a first
    # SIGTERM asks a rank to stop at its next step, and torchrun's SIGKILL comes 30 s later): the
    # test ends it by its pid once rank 0 wrote the summary.
    wait_for(lambda: (tmp_path / "s.json").exists() or p.proc.poll() is not None, 120)
    os.kill(int(marker.read_text()), signal.SIGKILL)
    assert p.wait(60) == 1, p.output
    s = read_json(tmp_path / "s.json")
    folder = runs / "hung" / "stacks"
    assert s["status"] == "FAILED" and s["error"] == (
        f"a collective waited past dist.timeout_s = 10 s: never reached it: rank 1 on {host} at {pipe}:{HANG_LINE} in loss; "
        f"every rank's stack in {folder}"
    ), s["error"]
    names = {f"rank0-{host}.txt", f"rank1-{host}.txt"}
    assert {x.name for x in folder.iterdir()} == names
    assert f'File "{pipe}", line {HANG_LINE} in loss' in (folder / f"rank1-{host}.txt").read_text()
    assert "Timed out waiting 10000ms" in (folder / f"rank0-{host}.txt").read_text()
    artifacts = next(tmp_path.glob(f"**/{s['run_id']}/artifacts"))
    assert {x.name for x in (artifacts / "stacks").iterdir()} == names
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        [(status,)] = con.execute("SELECT status FROM runs WHERE run_uuid = ?", (s["run_id"],)).fetchall()
        tag = con.execute(
            "SELECT value FROM tags WHERE run_uuid = ? AND key = 'raylane.error'", (s["run_id"],)
        ).fetchall()
    assert status == "FAILED" and tag == [(s["error"],)]  # the UI says why, as the terminal did
    # The run is over: `raylane stacks` says so in one line (rank 1, killed by torchrun, left its record).
    wait_for(lambda: main(["stacks", "hung", "--storage-path", str(runs)]) == 2, 40, 0.5)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"raylane: stacks: run hung is not live: no rank of it runs (its folder: {runs / 'hung'})"


# Slow (~35 s on 2 busy cores, the shared head included): the ranks' side is the loop's, the same under every launcher (make test
# runs it under torchrun above; Ray's failure line: test_preemption); this checks a Ray worker answers.
@pytest.mark.slow
@pytest.mark.shared_ray
@pytest.mark.untracked
def test_raylane_stacks_prints_both_ranks_of_a_live_ray_run(run_cli, tmp_path, capsys):
    shutil.copy(HELPER, tmp_path / "pipe.py")
    (tmp_path / "cfg.yaml").write_text("pipeline: ./pipe.py\n")
    runs, marker = tmp_path / "runs", tmp_path / "hanging"
    sets = {
        "run.name": "hung",
        "run.storage_path": str(runs),
        "scaling.num_workers": "2",
        "dist.timeout_s": "120",
        "train.batch_size": "8",
        "model.hang_s": "600",
        "model.marker": str(marker),
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    p = run_cli("train", "cfg.yaml", *args, cwd=tmp_path)
    wait_for(lambda: marker.exists() or p.proc.poll() is not None, 180)
    assert p.proc.poll() is None, p.output
    assert main(["stacks", str(runs / "hung")]) == 0
    out = capsys.readouterr().out
    pipe = tmp_path / "pipe.py"
    assert (
        f"== rank 1 (pid {marker.read_text()}, {socket.gethostname()}): running, at {pipe}:{HANG_LINE} in loss" in out
    )
    assert "== rank 0 (pid " in out and "waiting in a collective" in out, out
