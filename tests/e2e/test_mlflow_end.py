"""A run whose MLflow server is gone at its end, and back later, on a real `mlflow server` the test
stops and starts: training finishes, one line says what MLflow did not take and where it is kept
(raylane.tracking.pending), and the next launch of the run, which has nothing to train, sends the
metric values at their steps and closes the run FINISHED. Before, the run stayed RUNNING for
good and its last values were dropped without a word (0 of 9 train/loss values)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import cli_env, read_json, wait_for

# 40 steps, a value of train/loss every 4, and 0.25 s a step (rank 0's fault-injected sleep): the
# server is stopped after the first values arrived, seconds before the end.
STEPS, EVERY = 40, 4
ARGS = (
    "train", "regression", "--local", "--set", "run.name=gone", "--set", f"train.max_steps={STEPS}",
    "--set", f"mlflow.log_every_n_steps={EVERY}", "--set", "mlflow.system_metrics=false",
    "--set", "mlflow.log_model=false",
)  # fmt: skip


@pytest.mark.slow  # ~30 s: two launches around a server stopped and started; make test keeps the records and closes them in-process (tests/unit/test_mlflow_pending.py) and loses no metric of a server down mid-run (test_mlflow_server.py)
def test_a_server_back_after_the_end_gets_the_run_closed_with_its_values_by_the_next_launch(
    run_cli, tmp_path, mlflow_server
):
    from mlflow.tracking import MlflowClient

    # MLflow's own retries off: a server that is gone answers at once, and the run ends sooner.
    env = cli_env(
        tmp_path,
        MLFLOW_TRACKING_URI=mlflow_server.uri,
        MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
        RAYLANE_FAULTS="slow@rank=0,ms=250",
    )
    first = run_cli(*ARGS, "--summary-json", "a.json", env=env, name="first")
    client = MlflowClient(mlflow_server.uri)

    def first_values() -> list:
        experiment = client.get_experiment_by_name("raylane")
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        return runs and client.get_metric_history(runs[0].info.run_id, "train/loss")

    wait_for(first_values, timeout_s=180)
    mlflow_server.stop()
    assert first.wait(300) == 0, first.output  # training does not wait for its tracking
    s = read_json(tmp_path / "a.json")
    assert s["status"] == "FINISHED" and s["steps"] == STEPS
    kept = Path(s["checkpoint"]).parent / "mlflow_pending"
    said = [line for line in first.output.splitlines() if "did not take the end of run" in line]
    assert len(said) == 1 and said[0].endswith(f"kept in {kept}"), first.output
    assert "run.name=gone sends its status FINISHED and the " in said[0], said[0]

    mlflow_server.start()
    assert client.get_run(s["run_id"]).info.status == "RUNNING"
    logged = [m.step for m in client.get_metric_history(s["run_id"], "train/loss")]
    assert len(logged) < STEPS // EVERY, logged  # some values never arrived

    again = run_cli(*ARGS, "--summary-json", "b.json", env=env, name="again")
    assert again.wait(180) == 0, again.output
    lines = again.output.splitlines()
    assert lines[0].startswith("run gone: already FINISHED at step 40"), again.output
    assert lines[1].startswith(f"MLflow run {s['run_id']} FINISHED closed, with the "), again.output
    run = client.get_run(s["run_id"])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(s["run_id"], "train/loss")] == list(
        range(EVERY, STEPS + 1, EVERY)
    )
    assert not list(kept.iterdir())  # all sent
