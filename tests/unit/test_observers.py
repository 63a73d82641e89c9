"""What the Trainer holds and tells of its loop (raylane.loop.observe.observer): each observer,
made as raylane.loop.run makes it, in a real one-process run of a tiny model on the local runtime
(tests/unit/test_trainer.py's), through `build_trainer`: the step times, the profiler, the hang
watch's watchdog, injected faults, and the Trainer's own figures; and the moments every observer
is told, in their order.

Each test names the bug it was checked against (planted, seen to fail, reverted)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
from typing import Any

import pytest
import torch

import raylane
from raylane.loop import run as run_module
from raylane.loop.observe import faults, hangs
from raylane.loop.observe.observer import Observer, observing, watching
from raylane.loop.observe.observers import Observers
from raylane.loop.observe.steptimes import StepTimes
from raylane.loop.protocols.result import RunResult
from raylane.loop.run import build_trainer, local_runtime, seed_everything
from raylane.loop.trainer import Trainer
from tests.unit.test_trainer import ROWS, _config, _data


class Moments(Observer):
    """An observer that keeps the moments it is told, as the Trainer tells them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def on_train_start(self, step: int) -> None:
        self.seen.append(("train_start", step))

    def on_step_start(self, step: int) -> None:
        self.seen.append(("step_start", step))

    def on_batch(self, step: int) -> None:
        self.seen.append(("batch", step))

    def on_step_end(self, step: int) -> None:
        self.seen.append(("step_end", step))

    def on_epoch_end(self, epoch: int) -> None:
        self.seen.append(("epoch_end", epoch))

    def on_train_end(self, error: BaseException | None) -> None:
        self.seen.append(("train_end", type(error).__name__ if error else None))


def trainer(cfg: raylane.BaseConfig, *, slow_batches: int = 0, hang_watch: Any = None) -> Trainer:
    """This process's Trainer over a tiny regression (ROWS rows, 6 steps an epoch at batch 8), as
    run_worker builds it; its first `slow_batches` batches take 0.5 s each to collate."""
    seed_everything(cfg.train.seed)
    made = [0]

    def collate(rows: list[Any]) -> Any:
        made[0] += 1
        if made[0] <= slow_batches:
            time.sleep(0.5)
        return torch.utils.data.default_collate(rows)

    pipe = raylane.Pipeline(
        model=torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)),
        train_set=_data(ROWS, 0),
        eval_set=_data(16, 1),
        loss_fn=torch.nn.functional.mse_loss,
        collate_fn=collate,
    )
    return build_trainer(cfg, local_runtime(cfg, lambda event: None), pipe, hang_watch=hang_watch)


def watched_by(monkeypatch: pytest.MonkeyPatch, observer: Observer) -> None:
    """The next Trainer built holds `observer` in its profiler's place (any observer fits there)."""
    made = run_module._observers
    monkeypatch.setattr(run_module, "_observers", lambda *a: dataclasses.replace(made(*a), profiler=observer))


# Planted: Trainer._run_epoch not calling the observers' on_step_end (no step counted), and its
# on_epoch_end left out of train(); each fails the sequence below.
def test_every_observer_is_told_each_moment_in_the_loops_order(tmp_path, monkeypatch):
    moments = Moments()
    watched_by(monkeypatch, moments)
    trainer(_config(tmp_path, "r", train={"max_epochs": 2})).train()
    epoch = [m for s in range(1, 7) for m in (("step_start", s), ("batch", s), ("step_end", s))]
    # An epoch's end is found asking for a batch there is none of (the step after its last); the
    # run's end is known from its step count.
    second = [(m, s + 6) for m, s in epoch]
    assert moments.seen == [
        ("train_start", 0),
        *epoch,
        ("step_start", 7),
        ("epoch_end", 0),
        *second,
        ("epoch_end", 1),
        ("train_end", None),
    ]


# Planted: `observing` calling on_train_end only when the block ends well.
def test_a_loop_that_fails_tells_every_observer_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "raise@rank=0,step=3")
    moments = Moments()
    watched_by(monkeypatch, moments)
    run = trainer(_config(tmp_path, "r"))
    with pytest.raises(faults.InjectedFault, match="injected failure on rank 0 at step 3"):
        run.train()
    # The fault raises in its own on_batch, before this observer's (the profiler's place: after it).
    assert moments.seen[-3:] == [("step_end", 2), ("step_start", 3), ("train_end", "InjectedFault")]
    assert run.step == 2


def test_only_the_observers_that_watch_a_moment_are_called_at_it():
    class Ends(Observer):
        def on_step_end(self, step: int) -> None:
            pass

    ends, plain = Ends(), Observer()
    assert watching([plain, ends], "on_step_end") == [ends.on_step_end]
    assert watching([plain, ends], "on_batch") == []
    with pytest.raises(ValueError, match="no observer moment 'on_step'"):
        watching([ends], "on_step")
    told: list[Any] = []

    class Told(Observer):
        def on_train_end(self, error: BaseException | None) -> None:
            told.append(error)

    with pytest.raises(KeyError), observing([Told(), Told()], 0):
        raise KeyError("x")
    assert [type(e) for e in told] == [KeyError, KeyError]


# Planted: StepTimes.on_step_end not overridden (the timer never ends a step: no rank's row);
# the last window's gather after the loop left out of train() (the steps since the last vote are
# lost: at world size 1 the vote comes every ~0.5 s, so all 12 here); and faults placed before
# the step timer in Observers.in_order (a slow loader's sleep timed as nobody's: data_s ~0).
@pytest.mark.parametrize(("fault", "slow_part"), [("slowdata", "data_s"), ("slow", "compute_s")])
def test_the_step_times_count_every_step_and_a_sleep_where_it_happens(tmp_path, monkeypatch, fault, slow_part):
    monkeypatch.setenv(faults.ENV, f"{fault}@rank=0,ms=40")
    run = trainer(_config(tmp_path, "r", train={"max_epochs": 2}))
    result = run.train()
    [row] = result.rank_times
    assert row["steps"] == result.steps == 12
    other = "compute_s" if slow_part == "data_s" else "data_s"
    assert row[slow_part] >= 0.04 and row[other] < 0.04, row
    assert row["step_s"] >= row[slow_part]


# Planted: StepProfiler.on_step_end not overridden (the trace's steps are missing), and
# on_train_end not closing it (a window the run cut short writes no trace).
def test_a_profiled_rank_traces_the_runs_steps_named_by_its_node(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYLANE_NODE_NAME", "node-p")  # the node's name in every record, not the host's
    profile = {"enabled": True, "ranks": [0], "activities": ["cpu"], "wait": 1, "warmup": 1, "active": 20}
    result = trainer(_config(tmp_path, "r", train={"max_epochs": 1}, profile=profile)).train()
    assert result.steps == 6
    trace = tmp_path / "r" / "profiles" / "trace-rank0-node-p.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    # Wait 1, warmup 1: recorded from step 3 on, to the loop's end (#7: after the last step).
    assert steps == {f"ProfilerStep#{s}" for s in range(3, 8)}


# Planted: HangWatch.on_step_start not overridden (the watchdog is never armed: no dump).
def test_the_hang_watchs_watchdog_is_armed_by_the_steps_and_dumps_a_slow_one(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "slow@rank=0,ms=1500,step=3")  # the last step outlasts the bound
    watch = hangs.HangWatch(str(tmp_path / "r"), 0, 2, bound_s=0.5)
    watch.start()
    try:
        trainer(_config(tmp_path, "r", train={"max_epochs": None, "max_steps": 3}), hang_watch=watch).train()
        dump = watch.entry.watchdog_file.read_text()
    finally:
        watch.close()
    assert "in _sleep" in dump and "in _run_epoch" in dump, dump


# Planted: FaultPlan.on_batch not overridden (the raise never comes: the run finishes).
def test_a_planned_fault_raises_at_its_step_with_the_batch_in_hand(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "raise@rank=0,step=4")
    run = trainer(_config(tmp_path, "r"))
    with pytest.raises(faults.InjectedFault, match="^injected failure on rank 0 at step 4$"):
        run.train()
    assert run.step == 3 and run.batch_in_epoch == 3


# Planted: RunFigures.on_step_end not marking the end of the warm-up (the result's step time
# counts the 3 slow first batches: >= 0.125 s); checkpoint_wait not adding the save's time (0.0);
# on_epoch_end not overridden (no epoch_end_s).
def test_the_figures_leave_out_the_warm_up_and_count_the_checkpoint_waits(tmp_path):
    cfg = _config(tmp_path, "r", train={"max_epochs": 2}, checkpoint={"async_save": False, "every_n_steps": 2})
    result: RunResult = trainer(cfg, slow_batches=3).train()
    assert result.steps == 12 and result.train_wall_s >= 1.5  # the first 3 batches took 0.5 s each
    assert result.step_time_s < 0.06, result.step_time_s  # the 9 steps after them, a few ms each
    assert result.checkpoint_stall_s > 0  # saves at steps 2, 4, 8, 10 (6: its epoch end; 12: the end)
    assert len(result.epoch_end_s) == 2 and 1.5 < result.epoch_end_s[0] < result.epoch_end_s[1] <= result.train_wall_s
    assert result.train_s < 1.5 and result.memory["state_bytes_per_rank"] > 0  # train_s: from the warm-up's end


def test_observers_are_told_in_their_order_the_step_timer_first():
    plan, profiler, figures = faults.FaultPlan([], 0), Observer(), Observer()
    times = StepTimes(2, 1.5, 3, active=True)
    assert Observers(step_times=times, profiler=profiler, faults=plan).in_order(figures) == [
        times,
        plan,
        profiler,
        figures,
    ]
    off = StepTimes(2, 1.5, 3, active=True, enabled=False)
    assert Observers(step_times=off).in_order() == []  # stragglers.enabled false: nothing timed
