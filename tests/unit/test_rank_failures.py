"""A torchrun rank's failure, said by rank 0 (raylane.loop.observe.rankfailures, raylane.session.TorchrunEnding),
over a real TCPStore in this process, as torchrun's agent holds one: which errors are echoes of
another rank's, the records and the one line, and how each way a rank's run ends is said; the
SIGTERM guard with real signals. The whole path under torchrun: tests/e2e/test_torchrun_failures.py."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from raylane.loop.observe import rankfailures
from raylane.loop.observe.hangs import HangError
from raylane.results import Status
from raylane.session import TorchrunEnding

GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:36278. This is typically caused by a remote worker crashing."
)


@pytest.fixture
def store(monkeypatch):
    """torchrun's store, as its agent holds it, in this process; the environment a rank of 2 sees."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    return server


@pytest.fixture
def sigterm():
    """SIGTERM's handler as it was, back after the test."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_an_echo_is_a_peer_gone_or_a_timeout_never_the_cause():
    assert rankfailures.is_echo(RuntimeError(GLOO))
    assert rankfailures.is_echo(RuntimeError("[../pair.cc:598] Connection reset by peer"))
    assert rankfailures.is_echo(RuntimeError("[../pair.cc:446] Timed out waiting 10000ms for recv operation"))
    try:  # raised from one: a user's wrapper around a collective
        try:
            raise RuntimeError(GLOO)
        except RuntimeError as inner:
            raise ValueError("my all_reduce failed") from inner
    except ValueError as outer:
        assert rankfailures.is_echo(outer)
    assert not rankfailures.is_echo(ValueError("too many values to unpack (expected 2)"))
    assert not rankfailures.is_echo(FloatingPointError("non-finite loss or gradients at step 3"))
    # raylane's own hang report names the ranks that never came: the cause, timed out or not
    assert not rankfailures.is_echo(HangError("a collective waited past dist.timeout_s = 10 s: never reached it"))


def test_the_records_come_back_and_the_first_error_by_time_leads_the_line(store):
    assert rankfailures.recorded() == []
    assert rankfailures.publish(3, "ValueError: late", "Traceback 3", "/logs/3.log")
    time.sleep(0.01)
    assert rankfailures.publish(1, "ValueError: late", "Traceback 1", "/logs/1.log")
    early = rankfailures.RankFailure(2, "KeyError: 'x'", time.time() - 5, "node-b", "/logs/2.log", "Traceback 2")
    store.append(rankfailures.KEY, early.to_json() + "\n")
    store.append(rankfailures.KEY, '{"rank": 7, "line": "cut sho\n')  # a rank killed mid-write
    found = rankfailures.recorded()
    assert [(f.rank, f.line) for f in found] == [(3, "ValueError: late"), (1, "ValueError: late"), (2, "KeyError: 'x'")]
    assert found[0].traceback == "Traceback 3" and found[0].log == "/logs/3.log"
    assert rankfailures.first_line(found) == "training failed on rank 2: KeyError: 'x'; ranks 1, 3: ValueError: late"
    assert [f.rank for f in rankfailures.said(found)] == [1, 2, 3]
    many = [rankfailures.RankFailure(r, f"E{r}", r, "h") for r in range(5)]
    assert rankfailures.first_line(many) == (
        "training failed on rank 0: E0; rank 1: E1; rank 2: E2 (and 2 other errors)"
    )
    assert [f.rank for f in rankfailures.said(many)] == [0, 1, 2]


def test_no_store_is_no_record_within_the_bound(monkeypatch):
    monkeypatch.setattr(rankfailures, "STORE_TIMEOUT_S", 0.5)
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: no store at all
    assert rankfailures.recorded(wait_s=5) == [] and not rankfailures.publish(0, "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens
    started = time.monotonic()
    assert rankfailures.recorded(wait_s=0.2) == [] and not rankfailures.publish(1, "x")
    assert time.monotonic() - started < 8  # connecting to a store that is gone: about twice its timeout


def test_a_rank_records_its_own_error_and_rank_0_says_it_for_its_echo(store, sigterm):
    other = TorchrunEnding(1)
    assert (
        other.failed(RuntimeError(GLOO))
        == f"RuntimeError: {GLOO.split('. ')[0]}. This is typically caused by a remote worker crashing."
    )
    assert rankfailures.recorded() == []  # an echo is not recorded
    assert other.failed(ValueError("bad shape")) == "ValueError: bad shape"
    [record] = rankfailures.recorded()
    assert (record.rank, record.line) == (1, "ValueError: bad shape") and "ValueError: bad shape" in record.traceback

    zero = TorchrunEnding(0)
    assert zero.failed(RuntimeError(GLOO)) == "training failed on rank 1: ValueError: bad shape"
    assert [f.rank for f in zero.said] == [1]
    assert zero.over
    # Rank 0's own error, not an echo, is its own line: a real error of the run.
    assert TorchrunEnding(0).failed(FloatingPointError("non-finite loss at step 3")) == (
        "FloatingPointError: non-finite loss at step 3"
    )


def test_a_signal_is_a_failure_when_a_rank_failed_and_an_interrupt_otherwise(store, sigterm, monkeypatch):
    monkeypatch.setattr(rankfailures, "READ_WAIT_S", 0.5)
    zero = TorchrunEnding(0)
    started = time.monotonic()
    assert zero.interrupted(KeyboardInterrupt()) == (Status.KILLED, "interrupted")
    assert time.monotonic() - started >= rankfailures.READ_WAIT_S - 0.5  # bounded wait for a record
    cut = KeyboardInterrupt()
    cut.__context__ = FloatingPointError("non-finite loss at step 3")  # the signal came on the way out
    assert TorchrunEnding(0).interrupted(cut) == (Status.FAILED, "FloatingPointError: non-finite loss at step 3")
    rankfailures.publish(1, "ValueError: bad shape")
    assert TorchrunEnding(0).interrupted(KeyboardInterrupt()) == (
        Status.FAILED,
        "training failed on rank 1: ValueError: bad shape",
    )
    assert TorchrunEnding(2).interrupted(KeyboardInterrupt()) == (Status.KILLED, "interrupted")


def _term() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100):  # the handler runs at the next bytecode of the main thread
        time.sleep(0.001)


def test_the_sigterm_guard(store, sigterm):
    asked = []
    signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))  # preemption's stop request
    ending = TorchrunEnding(0)
    _term()
    assert asked == [signal.SIGTERM]  # no rank failed: a stop asked by a person, as before

    rankfailures.publish(1, "ValueError: bad shape")
    with pytest.raises(KeyboardInterrupt):  # a rank failed: stop now, no checkpoint to agree on
        _term()
    try:
        raise FloatingPointError("this rank's own")
    except FloatingPointError:
        _term()  # on its way out already: left alone, said with the others'
    ending.over = True
    _term()  # the end is decided: rank 0 closes the run and writes the summary
    assert asked == [signal.SIGTERM]
