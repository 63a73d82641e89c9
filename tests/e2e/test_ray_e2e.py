"""`raylane train` end to end as a newcomer runs it (`make run`: the shipped digits config, 12 epochs
on 2 gloo workers of an embedded Ray cluster, MLflow on into a fresh database): the run, its
checkpoint and MLflow records; and what it prints (issue 21): raylane's own lines and nothing of
Ray, MLflow, Tune or torch (those go to a log file; `--verbose` prints them), with figures that
agree: the last progress line, the final block, the summary and MLflow give the same loss and
samples/s for the same steps. One run serves every check here: an embedded cluster's start-up is
the slowest part of it."""

from __future__ import annotations

import math
import re
import sqlite3
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import RAYLANE, REPO, CliProcess, cli_env, read_json, wait_for
from tests.helpers.own_lines import foreign

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`make run`'s command: an embedded Ray of its own, and MLflow on, into a fresh database
    (whose set-up MLflow announces). Yields (its folder, the exited process)."""
    tmp = tmp_path_factory.mktemp("default-run")
    env = cli_env(tmp, new_database=False)  # MLflow lays it out: its chatter is checked below
    env.pop("RAYLANE_VERBOSE", None)  # as a newcomer's shell has it (the CLI's main, run in-process, sets it)
    proc = CliProcess(
        [
            *RAYLANE,
            "train",
            str(REPO / "pipelines" / "digits.yaml"),
            "--set",
            "scaling.num_workers=2",
            "--set",
            "run.name=digits2",
            "--summary-json",
            "s.json",
        ],
        tmp,
        env,
        tmp / "out.log",
    )
    try:
        assert proc.wait(300) == 0, proc.output
        yield tmp, proc
    finally:
        proc.kill_group()


def test_digits_on_two_ray_workers(default_run):
    tmp_path, proc = default_run
    # The embedded cluster goes with the run (the driver skips the interpreter's teardown, so
    # this checks that Ray's own shutdown still ran): no Ray daemon or worker outlives it, and
    # Ray's autoscaler monitor was stopped without reporting itself failed.
    assert wait_for(lambda: not proc.session_pids(), 15)
    assert "autoscaler failed" not in proc.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["error"] is None
    assert s["metrics"]["accuracy"] >= 0.95
    assert (s["world_size"], s["backend"]) == (2, "gloo")
    assert s["epochs"] == 12 and s["steps"] == 12 * math.ceil(1438 / 64)
    assert s["samples_per_s"] > 0 and s["wall_s"] > 0
    assert s["timing"]["launch_to_first_step_s"] > 0
    ckpt = Path(s["checkpoint"])
    assert ckpt.is_dir() and ckpt.name == f"checkpoint_{s['steps']:09d}"
    # DDP's state, the same on every rank, written by rank 0 in one file with each rank's generators.
    assert sorted(p.name for p in ckpt.iterdir()) == ["manifest.json", "state.pt"]
    # The outcome the user reads at the end of the log.
    assert f"MLflow run id: {s['run_id']}" in proc.output and str(ckpt) in proc.output
    assert "mlflow ui --backend-store-uri" in proc.output

    client = MlflowClient(s["tracking_uri"])
    run = client.get_run(s["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "digits2"
    params = run.data.params
    assert params["scaling.num_workers"] == "2" and params["train.batch_size"] == "32"
    assert params["optim.name"] == "adam" and params["pipeline"] == "digits"
    loss = client.get_metric_history(s["run_id"], "train/loss")
    assert [m.step for m in loss] == list(range(10, s["steps"] + 1, 10)) + ([s["steps"]] if s["steps"] % 10 else [])
    acc = client.get_metric_history(s["run_id"], "eval/accuracy")
    assert len(acc) == 12 and acc[-1].value == pytest.approx(s["metrics"]["accuracy"])
    assert loss[-1].value < loss[0].value


def test_a_default_run_prints_only_raylane_lines(default_run):
    tmp, proc = default_run
    output = proc.output
    assert not foreign(output), "\n".join(foreign(output))
    # What the libraries said went to the log file the final block names.
    log = Path(re.search(r"^  library log: +(\S+)", output, re.MULTILINE).group(1))
    assert log.parent == tmp / "raylane-home" / "logs"
    assert "Creating initial MLflow database tables" in log.read_text()


def test_the_last_progress_line_the_summary_and_mlflow_agree(default_run):
    tmp, proc = default_run
    output = proc.output
    summary = read_json(tmp / "s.json")
    last = [ln for ln in output.splitlines() if ln.startswith("[raylane] epoch") and " step " in ln][-1]
    found = re.search(r"step (\d+)/\d+ .* loss ([\d.]+) ([\d,]+) samples/s \(steps (\d+)-(\d+)\)", last)
    assert found, last
    step, loss, rate, first, to = found.groups()
    assert to == step == str(summary["steps"])  # the last step's figures, not an earlier window's
    window = summary["last_window"]
    assert (window["first_step"], window["last_step"]) == (int(first), int(to))
    assert (f"{window['loss']:.4f}", f"{window['samples_per_s']:,.0f}") == (loss, rate)
    assert f"  train loss:    {loss} (steps {first}-{to}, rank 0)" in output
    whole = f"{summary['samples_per_s']:,.0f}"
    assert f"  throughput:    {rate} samples/s (steps {first}-{to}), {whole} samples/s (whole run)" in output

    # MLflow's own table of logged values, read without importing MLflow (seconds on 2 busy cores).
    with sqlite3.connect(tmp / "mlflow.db") as db:
        logged = {
            (key, at): value
            for key, at, value in db.execute(
                "SELECT key, step, value FROM metrics WHERE run_uuid = ?", (summary["run_id"],)
            )
        }

    def at_last_step(key: str) -> float:
        return logged[(key, int(step))]

    assert f"{at_last_step('train/loss'):.4f}" == loss
    assert f"{at_last_step('train/samples_per_s'):,.0f}" == rate
    assert f"{at_last_step('run/samples_per_s'):,.0f}" == whole


@pytest.mark.shared_ray
@pytest.mark.untracked
@pytest.mark.slow  # another Ray run (~15 s); the quiet default is checked by every Ray run's output in make test
def test_verbose_shows_what_ray_prints(run_cli):
    proc = run_cli("train", "digits", "--verbose", "--set", "train.max_steps=2")
    assert proc.wait(300) == 0, proc.output
    theirs = foreign(proc.output)
    assert any(re.match(r"(\x1b\[\d+m)?\((TrainController|RayTrainWorker) pid=\d+", ln) for ln in theirs), proc.output
