"""The events between rank 0 and the driver are typed (raylane.loop.protocols.events): each kind pickles, as
it must to cross Ray's event actor, the Reporter sends nothing else, and the driver's listeners
read them as they read the old dicts."""

from __future__ import annotations

import dataclasses
import io
import pickle
import typing

import pytest

from raylane.loop.observe.startup import StartupTimes, with_phases
from raylane.loop.protocols.events import (
    Candidate,
    Checkpoint,
    CheckpointFailed,
    End,
    Eval,
    Event,
    FirstStep,
    Handover,
    Log,
    Progress,
    ReplicaHealed,
    ReplicaQuorum,
    Round,
    SearchEnd,
    SearchStart,
    Start,
    Startup,
    Straggler,
)
from raylane.loop.protocols.result import Fit, Outcome, SearchResult
from raylane.loop.reporting import Reporter
from raylane.tracking.progress import ProgressDisplay
from raylane.tracking.resizes import Resizes
from tests.helpers.run_result import run_result


def _start(world_size: int = 2, **changes) -> Start:
    return Start(
        **{"total_steps": 20, "steps_per_epoch": 10, "max_epochs": 2, "world_size": world_size, "host": "h", **changes}
    )


def _checkpoint(step: int, epoch: int = 0) -> Checkpoint:
    return Checkpoint(
        step=step,
        location=f"/runs/r/checkpoint_{step:09d}",
        epoch=epoch,
        metrics={"loss": 0.5},
        speed={"samples_per_s": 10.0},
        time_unix=1000.0 + step,
    )


ONE_OF_EACH = [
    _start(
        resumed_from_step=4,
        skipped_checkpoints=[{"path": "/c", "reason": "damaged"}],
        strategy="ddp",
        strategy_tags={"raylane.strategy": "ddp"},
        startup={"pipeline": 1.0},
    ),
    FirstStep(step=5, time_unix=1.0, startup={"first_batch": 0.5}),
    Progress(epoch=0, step=6, window={"first_step": 5, "last_step": 6, "loss": 0.5}, state={"lr": 0.1}),
    Eval(epoch=0, step=10, metrics={"accuracy": 0.9}, epoch_end=False),
    _checkpoint(10),
    CheckpointFailed(step=11, error="no space left"),
    Log(rank=1, level="warning", message="slow"),
    Straggler(record={"rank": 1, "node": "n1"}, line="straggler: rank 1 on n1 takes 2.0x ..."),
    ReplicaHealed(group=1, step=38, from_step=0, seconds=0.1),
    ReplicaQuorum(step=9, alive=1, groups=2),
    Handover(time_unix=2.0, result=run_result(steps=12, stop_reason="more workers fit", preempted=True, growing=True)),
    End(time_unix=3.0, result=run_result(steps=20, epochs=2, last_window={"first_step": 11, "last_step": 20})),
    Startup(phases={"fit": 0.1}),
    SearchStart(time_unix=0.2),
    Candidate(index=0, replayed=True, outcome=Outcome({"train.batch_size": 8}, replayed=True)),
    Round(index=0, rounds=2, replayed=False, outcome=Outcome({"train.batch_size": 8}, rounds=2, samples_per_s=9.5)),
    SearchEnd(
        time_unix=4.0,
        result=SearchResult(
            candidates=[Outcome({"train.batch_size": 8}, rounds=2), Outcome({"train.batch_size": 16}, Fit.OOM)],
            wall_s=3.5,
            world_size=2,
            estimate_margin=0.1,
            device="cpu",
        ),
    ),
]


def test_every_kind_pickles_and_round_trips():
    assert {type(e) for e in ONE_OF_EACH} == set(typing.get_args(Event))
    for event in ONE_OF_EACH:
        back = pickle.loads(pickle.dumps(event))
        assert type(back) is type(event) and back == event
        assert dataclasses.asdict(back) == dataclasses.asdict(event)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ONE_OF_EACH[0].world_size = 3
    with pytest.raises(TypeError, match="steps"):  # a misspelt field fails where it is sent
        FirstStep(steps=5, time_unix=1.0)


def test_the_display_follows_a_restarted_group():
    out = io.StringIO()
    display = ProgressDisplay(stream=out, live=False, line_interval_s=0)
    for event in [
        _start(4, strategy="ddp", strategy_reason="fits"),
        FirstStep(step=1, time_unix=100.0),
        Progress(epoch=0, step=5, window={"first_step": 1, "last_step": 5, "loss": 0.5}),
        _checkpoint(5),
        Handover(time_unix=110.0, result=run_result(steps=5, stop_reason="Ray's preemption notice", node_leaving=True)),
        _start(
            2,
            resumed_from_step=5,
            resumed_from="checkpoint_000000005",
            skipped_checkpoints=[{"path": "/runs/r/checkpoint_000000007/", "reason": "no manifest"}],
        ),
        FirstStep(step=6, time_unix=130.0),
        CheckpointFailed(step=8, error="disk full"),
        Log(rank=1, level="warning", message="slow"),
        Log(rank=0, level="warning", message="slow"),
        _checkpoint(10, epoch=1),
        Eval(epoch=1, step=10, metrics={"loss": 0.25}),
        End(time_unix=140.0, result=run_result(steps=20, epochs=2)),
    ]:
        display.handle(event)
    assert display.starts == 2 and [c.step for c in display.checkpoints] == [5, 10]
    assert display.first_step_unix == 100.0 and display.first_steps_unix == [100.0, 130.0]
    assert display.end_unix == 140.0 and display.result == run_result(steps=20, epochs=2)
    assert display.info["world_size"] == 2 and display.info["step"] == 20
    assert display.skipped_checkpoints == [{"path": "/runs/r/checkpoint_000000007/", "reason": "no manifest"}]
    lines = out.getvalue().splitlines()
    assert lines[0] == "[raylane] strategy ddp (fits)"
    assert "[raylane] epoch 1/2 step 5/20 (25%) loss 0.5000 (steps 1-5) eta ?" in lines
    assert (
        "[raylane] Ray's preemption notice: checkpointed at step 5; the group restarts without the leaving node"
        in lines
    )
    assert "[raylane] worker group restarted (1)" in lines and "[raylane] resumed from step 5" in lines
    assert "[raylane] checkpoint_000000007 skipped: no manifest; resuming from checkpoint_000000005" in lines
    assert "[raylane] warning: disk full" in lines and "[raylane] epoch 2 eval: loss 0.2500" in lines
    assert [ln for ln in lines if "slow" in ln] == ["[raylane] warning (rank 1): slow"]


def test_startup_phases_come_from_the_first_start_only():
    times = StartupTimes()
    for event in [
        Startup(phases={"fit": 10.0}),
        Startup(phases={"controller": 11.0}),
        _start(startup={"worker_imports": 12.0, "pipeline": 13.0}),
        FirstStep(step=1, time_unix=15.0, startup={"first_batch": 14.0}),
        _start(startup={"pipeline": 50.0, "ready": 51.0}),  # a restart is not start-up
        FirstStep(step=3, time_unix=60.0, startup={"first_batch": 59.0}),
    ]:
        times.on_event(event)
    phases = {k: v for k, v in times.unix.items() if k not in ("launch", "rank_process")}
    assert phases == {
        "fit": 10.0,
        "controller": 11.0,
        "worker_imports": 12.0,
        "pipeline": 13.0,
        "first_batch": 14.0,
        "first_step": 15.0,
    }


def test_resizes_are_found_from_the_starts():
    resizes = Resizes()
    for event in [
        _start(4),
        FirstStep(step=1, time_unix=0.0),
        Progress(epoch=0, step=7),
        _checkpoint(6),
        CheckpointFailed(step=9, error="x"),
        _start(2, resumed_from_step=6),
        FirstStep(step=7, time_unix=1e12),  # a node was lost
        Handover(time_unix=0.0, result=run_result(steps=10, stop_reason="more workers fit", growing=True)),
        _start(4, resumed_from_step=10),
        FirstStep(step=11, time_unix=1e12),
        _start(4, resumed_from_step=10),
        FirstStep(step=11, time_unix=1e12),
    ]:  # same size: no resize
        resizes.on_event(event)
    assert all(r.pop("time_lost_s") > 0 for r in resizes.resizes)
    assert resizes.resizes == [
        {"step": 6, "from": 4, "to": 2, "reason": "a worker or node was lost", "steps_lost": 3},
        {"step": 10, "from": 2, "to": 4, "reason": "more workers fit", "steps_lost": 0},
    ]


def test_the_reporter_sends_only_events_the_listeners_read():
    """Rank 0's Reporter, through run.py's start-up stamping, to the driver's listeners by way of
    pickle (as across Ray's event actor)."""
    out = io.StringIO()
    display, times, resizes = ProgressDisplay(stream=out, live=False, line_interval_s=0), StartupTimes(), Resizes()
    sent: list[Event] = []

    def driver(event: Event) -> None:
        assert isinstance(event, Event), event
        sent.append(event)
        event = pickle.loads(pickle.dumps(event))
        for listener in (display.handle, times.on_event, resizes.on_event):
            listener(event)

    reporter = Reporter(is_rank_zero=True, publish=with_phases(driver, {"pipeline": 5.0}))
    reporter.on_start(
        total_steps=4,
        steps_per_epoch=2,
        max_epochs=2,
        world_size=1,
        resumed_from_step=None,
        resumed_from=None,
        skipped_checkpoints=[],
        strategy="single",
        strategy_reason="one rank",
        strategy_tags={"raylane.strategy": "single"},
    )
    reporter.on_train_metrics(1, {"loss": 1.5, "samples_per_s": 8.0, "lr": 0.1})
    reporter.on_step(epoch=0, step=1, first=True)
    reporter.on_eval(epoch=0, step=2, metrics={"loss": 1.25})
    reporter.on_checkpoint(step=2, location="/runs/r/checkpoint_000000002", epoch=1, metrics={"loss": 1.25})
    reporter.on_checkpoint_failed(step=4, error="disk full")
    result = reporter.on_end(
        run_result(steps=4, epochs=2, preempted=True, node_leaving=True, stop_reason="a node is leaving")
    )
    reporter.on_end(run_result(steps=4, epochs=2))
    assert [type(e) for e in sent] == [Start, FirstStep, Progress, Eval, Checkpoint, CheckpointFailed, Handover, End]
    assert sent[0].host and sent[0].startup == {"pipeline": 5.0} and sent[1].startup == {"pipeline": 5.0}
    assert sent[2].window == {"first_step": 1, "last_step": 1, "loss": 1.5, "samples_per_s": 8.0}
    assert sent[2].state["lr"] == 0.1 and sent[2].state["total_steps"] == 4
    assert sent[4].speed == {} and sent[6].result == result
    assert display.starts == 1 and [c.location for c in display.checkpoints] == ["/runs/r/checkpoint_000000002"]
    assert display.result is not None and display.result.steps == 4 and display.first_step_unix == sent[1].time_unix
    assert times.unix["pipeline"] == 5.0 and times.unix["first_step"] == sent[1].time_unix
    assert "[raylane] epoch 1/2 step 1/4 (25%) loss 1.5000 8 samples/s (step 1) eta ?" in out.getvalue()
    assert resizes.resizes == []
