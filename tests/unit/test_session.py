"""One lifecycle for every launch (raylane.session): the one mapping from how a launch ended to its
status, a RunSession that closes its MLflow run exactly once on every way out (a real sqlite
store in tmp_path), and train, a sweep and autotune each closing theirs through it, KILLED, when
an interrupt comes while Ray starts. The same interrupt sent to each command while it joins a
cluster: tests/e2e/test_join.py."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import pytest

from raylane.errors import ConfigError, TrainingError
from raylane.results import Status
from raylane.session import RunSession, failure_text, outcome, ran, status_of


@pytest.fixture
def store(tmp_path, monkeypatch) -> str:
    """A fresh MLflow sqlite store in tmp_path, as MLFLOW_TRACKING_URI; the test runs in tmp_path."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # its tables made
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    return uri


@pytest.fixture
def own_sigterm():
    """A launch installs its SIGTERM handler in this (the main) thread: given back after the test."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def _run(uri: str, name: str):
    """A RUNNING MLflow run of experiment 'session', as a launch opens one."""
    from mlflow.tracking import MlflowClient

    from raylane.tracking.runs import RunHandle

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("session")
    exp_id = exp.experiment_id if exp else client.create_experiment("session")
    return RunHandle(client.create_run(exp_id, run_name=name).info.run_id, exp_id, uri, False)


def _statuses(uri: str) -> dict[str, str]:
    """Every run of the store: its name -> its MLflow status."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    return {r.info.run_name: r.info.status for r in runs}


def test_one_mapping_from_how_a_launch_ended_to_its_status():
    assert status_of(None) == Status.FINISHED
    assert status_of(ValueError("x")) == Status.FAILED
    assert status_of(ConfigError("x")) == Status.FAILED
    assert status_of(KeyboardInterrupt()) == Status.KILLED  # Ctrl-C, and SIGTERM raised as one
    assert status_of(SystemExit(1)) == Status.KILLED  # Ray's own SIGTERM handler
    assert ran(preempted=True) == Status.KILLED and ran(preempted=False) == Status.FINISHED
    assert outcome(KeyboardInterrupt()) == (Status.KILLED, "interrupted")
    assert outcome(TrainingError("rank 1 raised ValueError: bad")) == (Status.FAILED, "rank 1 raised ValueError: bad")
    assert outcome(RuntimeError("first\nsecond")) == (
        Status.FAILED,
        "RuntimeError: first (the rest in the library log)",
    )
    assert failure_text(ValueError("one line")) == "ValueError: one line"


def _exit(session: RunSession, how: str) -> None:
    if how == "returned":
        session.close(Status.FINISHED)
    elif how == "error":
        raise ValueError("boom")
    elif how == "interrupt":
        raise KeyboardInterrupt
    elif how == "ray's exit":
        raise SystemExit(1)
    elif how == "closed, then interrupted":  # a preempted run's KILLED close, then a second signal
        session.close(Status.KILLED)
        raise KeyboardInterrupt


def test_a_session_closes_its_run_once_on_every_way_out_then_the_rest_then_the_lease(store, tmp_path):
    """Returned, an error, an interrupt, Ray's SystemExit, a close then a second signal; and a run
    still being opened when the interrupt comes."""
    expected = {
        "returned": "FINISHED",
        "error": "FAILED",
        "interrupt": "KILLED",
        "ray's exit": "KILLED",
        "closed, then interrupted": "KILLED",
    }
    for how in expected:
        order: list[str] = []
        folder = tmp_path / "runs" / how
        with pytest.raises((ValueError, KeyboardInterrupt, SystemExit)) if how != "returned" else nullcontext():
            with RunSession() as session:
                session.lease(folder, f"run {how!r}", "run.name", how, lambda: "other")
                session.track(_run(store, how))
                session.defer(lambda seen, name: seen.append("deferred: " + _statuses(store)[name]), order, how)
                assert (folder / "raylane_lease.json").exists()
                _exit(session, how)
        assert order == [f"deferred: {expected[how]}"], how  # the run was closed before the rest ran
        assert not (folder / "raylane_lease.json").exists(), how  # and the lease given back last
    assert _statuses(store) == expected

    # An interrupt while the run opens (on a pool, beside Ray's start): the opening thread closes it.
    opening = threading.Event()

    def slow_open():
        opening.wait(10)
        return _run(store, "slow")

    with pytest.raises(KeyboardInterrupt), RunSession() as session:
        pool = session.enter(ThreadPoolExecutor(1))
        session.open_on(pool, slow_open)
        threading.Timer(0.3, opening.set).start()
        raise KeyboardInterrupt
    assert _statuses(store)["slow"] == "KILLED"


def test_the_line_a_launch_failed_with_is_its_runs_tag_and_a_finished_run_has_none(store):
    """`raylane.error`: the terminal's one line, on every way a launch fails or stops; none on a
    run that closes FINISHED (one recorded FINISHED before stays so: closes_as_run)."""
    from mlflow.tracking import MlflowClient

    from raylane.tracking.runs import ERROR_TAG

    handles = {}
    for how, close in {
        "failed": lambda s: s.close(Status.FAILED, "training failed on rank 1: ValueError: bad shape"),
        "finished": lambda s: s.close(Status.FINISHED, None),
        "raised": lambda s: (_ for _ in ()).throw(ValueError("boom\nmore")),
        "interrupted": lambda s: (_ for _ in ()).throw(KeyboardInterrupt()),
    }.items():
        with pytest.raises((ValueError, KeyboardInterrupt)) if how in ("raised", "interrupted") else nullcontext():
            with RunSession() as session:
                session.track(handles.setdefault(how, _run(store, how)))
                close(session)
    tags = {how: MlflowClient(store).get_run(h.run_id).data.tags.get(ERROR_TAG) for how, h in handles.items()}
    assert tags == {
        "failed": "training failed on rank 1: ValueError: bad shape",
        "finished": None,
        "raised": "ValueError: boom",
        "interrupted": "interrupted",
    }


def test_an_opener_that_lost_an_import_race_opens_the_run_once_more():
    """The opener imports MLflow beside the main thread's Ray: a half-imported module caught from
    the other thread fails it once (tests/e2e/test_join.py makes it happen in a real launch); a
    server that cannot be reached is no race, and not tried again."""
    from raylane.session import import_race

    tries: list[int] = []

    def opener(error: Exception):
        tries.append(1)
        if len(tries) == 1:
            raise error
        return "opened"

    race = AttributeError("partially initialized module 'mlflow' has no attribute 'version' (most likely ...)")
    with ThreadPoolExecutor(1) as pool:
        session = RunSession()
        session.open_on(pool, opener, race)
        assert session.handle() == "opened" and len(tries) == 2
        tries.clear()
        session.open_on(pool, opener, ConnectionError("[Errno 111] Connection refused"))
        assert session.handle() is None and len(tries) == 1  # said in one warning: training goes on untracked
    assert import_race(
        ImportError("cannot import name 'HTTPAdapter' from partially initialized module 'requests.adapters'")
    )
    assert not import_race(ImportError("No module named 'mlflow'")) and not import_race(ValueError("partial results"))


def test_the_openers_imports_and_the_main_threads_take_turns(tmp_path, monkeypatch):
    """The race above is prevented first: the opener's MLflow and the launch's Ray are imported
    one thread at a time (session.HEAVY_IMPORTS), so neither thread can catch the other's
    shared dependencies half-imported. Two slow modules imported from two threads never overlap."""
    from raylane.session import import_exclusively

    spans: dict[str, tuple[float, float]] = {}
    for name in ("slow_opener_dep", "slow_ray_dep"):
        (tmp_path / f"{name}.py").write_text(
            "import time, spans\n"
            f"start = time.monotonic(); time.sleep(0.3); spans.record({name!r}, start, time.monotonic())\n"
        )
    recorder = type(sys)("spans")
    recorder.record = lambda name, start, end: spans.__setitem__(name, (start, end))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "spans", recorder)
    monkeypatch.syspath_prepend(str(tmp_path))
    threads = [threading.Thread(target=import_exclusively, args=(n,)) for n in ("slow_opener_dep", "slow_ray_dep")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    (a_start, a_end), (b_start, b_end) = sorted(spans.values())
    assert a_end <= b_start, spans


def test_a_sigterm_that_lands_inside_a_gc_callback_still_interrupts_the_launch(own_sigterm, monkeypatch):
    """Python runs the handler at its next safe point, which can be a weakref's callback, where the
    interrupt it raises is dropped ("Exception ignored"): it is sent again, and the launch stops."""
    import gc
    import os
    import sys
    import weakref

    from raylane.session import raise_interrupt

    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # given back after the test
    signal.signal(signal.SIGTERM, raise_interrupt)

    class Payload:
        pass

    def on_collect(_ref):
        os.kill(os.getpid(), signal.SIGTERM)  # handled at the next safe point: still in here
        sum(range(1000))

    payload = Payload()
    watch = weakref.ref(payload, on_collect)
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        del payload
        gc.collect()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            pass
    assert watch() is None


def test_a_second_launch_of_a_held_run_is_refused_naming_the_holder(tmp_path):
    folder = tmp_path / "runs" / "r"
    with RunSession() as first:
        first.lease(folder, "run 'r'", "run.name", "r", lambda: "r-2")
        with pytest.raises(ConfigError, match="run.name"), RunSession() as second:
            second.lease(folder, "run 'r'", "run.name", "r", lambda: "r-2")
    with RunSession() as third:  # given back on leaving
        third.lease(folder, "run 'r'", "run.name", "r", lambda: "r-2")


class _Closes:
    """Every RunSession.close of the test: the status each launch closed its run with."""

    def __init__(self, monkeypatch) -> None:
        self.statuses: list[Status] = []
        original = RunSession.close

        def close(session: RunSession, status: Status, error: str | None = None) -> None:
            original(session, status, error)
            self.statuses.append(session.status)

        monkeypatch.setattr(RunSession, "close", close)


def _interrupted_ray_start(*args, **kwargs):
    time.sleep(0.2)  # the MLflow run, opened beside Ray's start, is still being opened
    raise KeyboardInterrupt


def test_train_a_sweep_and_autotune_each_end_killed_through_the_session_when_ray_start_is_interrupted(
    store, tmp_path, monkeypatch, capsys, own_sigterm
):
    """Each launch in turn, Ray's start interrupted as a Ctrl-C or SIGTERM would: one close, KILLED,
    through RunSession.close; its MLflow run (the sweep's and the search's parent) KILLED; its
    lease given back; one line; a summary, where the command writes one, KILLED."""
    import raylane.onray.cluster as cluster
    from raylane import api, driver
    from raylane.autotuning.driver import execute
    from raylane.onray.tune import run_sweep

    monkeypatch.setattr(cluster, "start_ray", _interrupted_ray_start)  # train, autotune
    monkeypatch.setattr(cluster, "init_ray", _interrupted_ray_start)  # the sweep's driver
    closes = _Closes(monkeypatch)

    summary_json = str(tmp_path / "train.json")
    run = api.prepare_train("digits", ["run.name=r"], summary_json=summary_json)
    summary = driver.train(run.cfg, use_ray=True, folder=run.folder, pipeline=run.pipeline, summary_path=summary_json)
    assert (summary.status, summary.error) == (Status.KILLED, "interrupted before training started")
    # One failure line and no traceback; the fresh-start line shows too when an earlier test of
    # this process left raylane's terminal logging on (as the CLI has it).
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("raylane:")] == [
        "raylane: interrupted while waiting for the Ray cluster; nothing was trained"
    ]
    assert "Traceback" not in err

    prepared = api.prepare_tune("digits-sweep", ["sweep.name=s"])
    with pytest.raises(KeyboardInterrupt):  # the CLI says "raylane: interrupted" and exits 130
        run_sweep(prepared.sweep, prepared.base, address=None, summary_path=None, register=None)

    out, autotune_json = str(tmp_path / "w.yaml"), str(tmp_path / "autotune.json")
    search = api.prepare_autotune("digits", ["run.name=a"], out=out, summary_json=autotune_json)
    summary = execute(search.section, search.cfg, use_ray=True, address=None, out=out, summary_path=autotune_json)
    assert (summary.status, summary.error) == (Status.KILLED, "interrupted")
    assert "raylane: autotune killed: interrupted" in capsys.readouterr().out

    assert closes.statuses == [Status.KILLED] * 3  # one close each, all through the session
    assert _statuses(store) == {"r": "KILLED", "s": "KILLED", "a": "KILLED"}
    assert not list(tmp_path.glob("runs/*/raylane_lease.json"))
    assert not Path(summary_json).exists()  # a run that never started writes no summary (it returns one)
    assert json.loads(Path(autotune_json).read_text())["status"] == "KILLED"
