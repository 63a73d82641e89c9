"""A sweep's MLflow runs on a real sqlite store (raylane.sweeps.runs), and what the sweep's driver
closes on SIGTERM or Ctrl-C (raylane.onray.trials.TrialRuns.interrupted) with no Ray running: every
trial's run still RUNNING once Ray has stopped, a run opened while Ray stops included; a run its
trial closed while the driver waited stays as its trial closed it. A sweep's runs continued by a rerun drop how the
interrupted launch ended. The whole path on a real sweep: tests/e2e/test_sweep_signals.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from raylane.config import load_config
from raylane.config.sweep import load_sweep
from raylane.results import Status
from raylane.session import raise_interrupt
from raylane.tracking.runs import ERROR_TAG, close_run


@pytest.fixture
def sweep(tmp_path, monkeypatch):
    """(sweep section, base config, tracking URI) of the shipped sweep on a fresh sqlite store."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # its tables made
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    section, base = load_sweep("digits-sweep")
    return section, base, uri


def _status(uri: str, run_id: str) -> tuple[str, str | None]:
    from mlflow.tracking import MlflowClient

    run = MlflowClient(uri).get_run(run_id)
    return run.info.status, run.data.tags.get(ERROR_TAG)


def test_the_driver_closes_every_trial_run_still_open_once_ray_has_stopped(sweep):
    from mlflow.tracking import MlflowClient

    from raylane.onray.trials import TrialRuns
    from raylane.sweeps.runs import open_children, open_parent, trial_run

    section, base, uri = sweep
    client = MlflowClient(uri)
    parent = open_parent(section, base, uri)
    cfg = load_config("digits")
    by_its_trial, training, starting = (trial_run(client, parent, f"t_0000{i}", section, cfg) for i in (0, 1, 2))
    for run_id in (by_its_trial, training):  # their rank 0 sent a step's loss: they have trained
        client.log_metric(run_id, "train/loss", 2.3, step=2)
    late: list[str] = []

    def stop_ray() -> None:  # a trial still starting opens its run before Ray has stopped it
        late.append(trial_run(client, parent, "t_00003", section, cfg))

    # One trial closes its own run while the driver waits, as a trial whose ranks stopped does.
    closes = threading.Timer(0.1, close_run, (parent_handle(parent, by_its_trial), Status.KILLED))
    closes.start()
    ended = TrialRuns(parent, section, 4).interrupted(stop_ray, timeout_s=1.5)
    closes.join()

    assert {_status(uri, run_id) for run_id in (training, starting, late[0])} == {("KILLED", "interrupted")}
    assert _status(uri, by_its_trial) == ("KILLED", "interrupted")  # why, as on the others
    assert _status(uri, parent.run_id) == ("RUNNING", None)  # the parent is the sweep's session's to close
    assert open_children(client, parent) == []
    assert (ended.trials, ended.checkpointed) == (4, 1)
    assert ended.line(section.name) == (
        "interrupted: sweep digits-asha stopped; the MLflow runs of its 4 running trials and its parent run closed "
        "KILLED, 1 checkpointed where it stopped; rerun the same command to continue the sweep"
    )


def test_a_rerun_continues_the_interrupted_runs_without_their_interrupted_tag(sweep):
    from mlflow.tracking import MlflowClient

    from raylane.sweeps.runs import open_children, open_parent, trial_run

    section, base, uri = sweep
    client = MlflowClient(uri)
    parent = open_parent(section, base, uri)
    trial = trial_run(client, parent, "t_00000", section, load_config("digits"))
    assert open_children(client, parent) == [trial]
    close_run(parent_handle(parent, trial), Status.KILLED, "interrupted")
    close_run(parent, Status.KILLED, "interrupted: sweep digits-asha stopped; ...")

    again = open_parent(section, base, uri)
    assert (again.run_id, again.resumed) == (parent.run_id, True)
    assert trial_run(client, again, "t_00000", section, load_config("digits")) == trial
    assert _status(uri, parent.run_id) == _status(uri, trial) == ("RUNNING", None)


def parent_handle(parent, run_id: str):
    """A handle on `run_id`, a trial's run under `parent`."""
    from raylane.tracking.runs import RunHandle

    return RunHandle(run_id, parent.experiment_id, parent.tracking_uri, False)


@pytest.fixture
def own_signals():
    """The stop installs its handlers in this (the main) thread: given back after the test."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, raise_interrupt)  # as a sweep's driver has it
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_a_signal_right_after_the_first_is_its_echo_and_a_later_one_cuts_the_stop_short(
    sweep, own_signals, monkeypatch
):
    """A terminal's Ctrl-C beside a wrapper's SIGTERM: the second, within 2 s, changes nothing and
    every run is closed; one later is the user asking again, raised as the first was."""
    from mlflow.tracking import MlflowClient

    from raylane.onray import trials
    from raylane.sweeps.runs import open_parent, trial_run

    section, base, uri = sweep
    client = MlflowClient(uri)
    parent = open_parent(section, base, uri)
    run = trial_run(client, parent, "t_00000", section, load_config("digits"))

    def stop_ray() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs here

    trials.TrialRuns(parent, section, 4).interrupted(stop_ray, timeout_s=0.5)
    assert _status(uri, run) == ("KILLED", "interrupted")

    monkeypatch.setattr(trials, "SECOND_SIGNAL_S", 0.0)
    again = trial_run(client, parent, "t_00000", section, load_config("digits"))
    with pytest.raises(KeyboardInterrupt):
        trials.TrialRuns(parent, section, 4).interrupted(stop_ray, timeout_s=0.5)
    assert _status(uri, again) == ("RUNNING", None)  # the user asked twice: the parent's session closes what it can
    assert signal.getsignal(signal.SIGTERM) is raise_interrupt  # the stop's handlers given back
