"""What MLflow did not take by a launch's end, kept for the next launch (raylane.tracking.pending),
on a real sqlite store and a real MetricLogger pointed at a server that is not there. The whole
path on a real `mlflow server` stopped and started again: tests/e2e/test_mlflow_end.py."""

from __future__ import annotations

import json

import pytest

from raylane.tracking import pending
from raylane.tracking.runs import MetricLogger, mlflow_client


@pytest.fixture
def store(tmp_path):
    from tests.conftest import cli_env

    uri = cli_env(tmp_path)["MLFLOW_TRACKING_URI"]  # a copy of a laid-out database: no migrations
    client = mlflow_client(uri)
    run_id = client.create_run(client.create_experiment("pending")).info.run_id
    return uri, run_id


def test_a_logger_whose_server_is_gone_keeps_what_it_did_not_send(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    pending.keep_for("r1", tmp_path / "run")
    logger = MetricLogger("http://127.0.0.1:1", "r1", flush_interval_s=0.1)  # nothing listens there
    logger.log({"train/loss": 0.5}, step=10)
    logger.log({"train/loss": 0.25}, step=20)
    logger.set_tags({"raylane.host": "h"})
    logger.close(timeout_s=60)
    [kept] = pending.read(tmp_path / "run")
    assert (kept.run_id, kept.tracking_uri, kept.status) == ("r1", "http://127.0.0.1:1", None)
    assert [(k, v, step) for k, v, _, step in kept.metrics] == [("train/loss", 0.5, 10), ("train/loss", 0.25, 20)]
    assert kept.tags == {"raylane.host": "h"}
    assert pending.count(pending.where("r1"), "r1") == 2


def test_the_next_launch_sends_the_values_and_closes_a_run_left_running(tmp_path, store):
    uri, run_id = store
    folder = tmp_path / "run"
    pending.keep_for(run_id, folder)
    pending.keep(run_id, uri, metrics=[("train/loss", 0.5, 1000, 10)], tags={"raylane.host": "h"})
    pending.keep(run_id, uri, metrics=[("train/loss", 0.25, 2000, 20)])
    pending.keep(run_id, uri, tags={"raylane.error": "boom"}, status="FAILED")
    (folder / pending.FOLDER / "torn.json").write_text("{")  # a writer killed mid-file: left, said
    client = mlflow_client(uri)
    assert client.get_run(run_id).info.status == "RUNNING"

    line = pending.settle(folder, "gone", mlflow_client)
    assert line == f"MLflow run {run_id} FAILED closed, with the 2 metric values an earlier launch could not send"
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["raylane.error"] == "boom"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(10, 0.5), (20, 0.25)]
    assert [p.name for p in (folder / pending.FOLDER).iterdir()] == ["torn.json"]
    assert pending.settle(folder, "gone", mlflow_client) is None  # nothing left to send


def test_a_server_still_gone_keeps_it_for_the_launch_after(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    pending.keep_for("r2", tmp_path / "run")
    pending.keep("r2", "http://127.0.0.1:1", metrics=[("train/loss", 1.0, 1, 1)], status="FINISHED")
    line = pending.settle(tmp_path / "run", "gone", mlflow_client)
    assert line == (
        f"MLflow still does not take what run gone kept for it (Connection refused): kept in "
        f"{tmp_path / 'run' / pending.FOLDER}"
    )
    [kept] = (tmp_path / "run" / pending.FOLDER).iterdir()
    assert json.loads(kept.read_text())["status"] == "FINISHED"
    assert pending.keep("no folder", "http://x") is None  # object storage: nowhere to keep it


def test_a_restarted_group_naming_a_straggler_again_keeps_the_first_line(store):
    """A group restarted on Ray (or by torchrun) starts its Reporter anew, and named rank 3 again
    with another line, its node's or its figures: the tag set at the first naming was overwritten.
    Set as first tags, the run keeps the first line, and a straggler named only later is added."""
    from raylane.loop.reporting import Reporter

    uri, run_id = store
    for lines in ({3: "rank 3 on node-1 takes 2.1x"}, {3: "rank 3 on node-2 takes 1.8x", 5: "rank 5 on node-0"}):
        logger = MetricLogger(uri, run_id, flush_interval_s=0.1)
        reporter = Reporter(is_rank_zero=True, publish=lambda event: None, metric_logger=logger)
        for rank, line in lines.items():
            reporter.on_straggler({"rank": rank}, line)
        logger.close(timeout_s=60)
    tags = mlflow_client(uri).get_run(run_id).data.tags
    assert tags["raylane.straggler.rank3"] == "rank 3 on node-1 takes 2.1x"
    assert tags["raylane.straggler.rank5"] == "rank 5 on node-0"
