"""The driver's relay of rank 0's events (raylane.onray.launch.pump) reads every event the run
sent, its End included, however the end of fit() falls against the drains: a trial whose End was
left in the sink closed FINISHED without its throughput and told Tune of one epoch less (the
ASHA sweep test's intermittent failure)."""

from __future__ import annotations

import threading

import pytest

from raylane.loop.protocols.events import End, Log
from raylane.onray import launch


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(launch, "EVENT_POLL_S", 0.01)


def _fit_until(release: threading.Event) -> threading.Thread:
    thread = threading.Thread(target=release.wait, daemon=True)
    thread.start()
    return thread


def test_an_end_sent_as_fit_returns_after_a_drain_is_still_read():
    release, seen = threading.Event(), []
    thread = _fit_until(release)
    batches = [[Log(0, "warning", "a step")], [End(1.0, {"done": True})]]

    def drain():
        batch = batches.pop(0) if batches else []
        if batch and isinstance(batch[0], Log):
            # rank 0 sends its End and fit() returns while this drain's answer is on its way back
            release.set()
            thread.join()
        return batch

    ended = launch.pump(thread, drain, lambda: None, seen.append)
    assert ended == {"done": True}
    assert [type(e).__name__ for e in seen] == ["Log", "End"]


def test_a_listener_that_gives_up_stops_the_workers_and_is_raised():
    release, stops = threading.Event(), []
    thread = _fit_until(release)

    def listener(event):
        raise SystemExit(0)  # tune.report when the scheduler stopped the trial

    def request_stop():
        stops.append(True)
        release.set()

    with pytest.raises(SystemExit):
        launch.pump(thread, lambda: [Log(0, "warning", "a step")], request_stop, listener)
    assert stops == [True]
