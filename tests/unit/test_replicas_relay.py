"""How the driver of a run with replica groups (raylane.onray.replicas.Replicas) passes its groups'
events on as the run's, and ends the run, in this process: each group's fit is a real Fit on its
own thread whose trainer returns or raises as Ray Train's would (no Ray started); the events are
the loop's own types. The end to end run on Ray: tests/e2e/test_ft_ray.py."""

from __future__ import annotations

import logging

import pytest
from ray.train.v2.api.exceptions import WorkerGroupError

from raylane.errors import TrainingError
from raylane.loop.protocols.events import End, Log, Progress, Start
from raylane.onray.fit import Fit
from raylane.onray.replicas import Replicas
from tests.helpers.run_result import run_result


class _Trainer:
    """A TorchTrainer's fit() as the driver sees it: returns, or raises what Ray Train raises."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    def fit(self) -> None:
        if self.error is not None:
            raise self.error


def _groups(*errors: BaseException | None) -> Replicas:
    groups = Replicas([Fit(_Trainer(e), sink=None, world_size=2) for e in errors])
    groups.start().join(10)
    return groups


def _start() -> Start:
    return Start(total_steps=60, steps_per_epoch=60, max_epochs=1, world_size=1, host="h")


def _end(steps: int) -> End:
    return End(time_unix=1.0, result=run_result(steps=steps))


def _lost(rank: int, message: str) -> WorkerGroupError:
    return WorkerGroupError(message, {rank: RuntimeError(message)})


def test_the_run_hears_one_start_each_groups_restart_in_a_line_and_the_best_groups_end(caplog):
    groups = _groups(None, None)
    progress = Progress(epoch=0, step=3, window=None, state={})
    first = groups.relay([[_start(), progress], [_start()]], [False, False])
    assert first == [first[0], progress] and isinstance(first[0], Start)  # group 1's first Start: not a restart
    with caplog.at_level(logging.WARNING, logger="raylane"):
        assert groups.relay([[], [_start()]], [False, False]) == []  # group 1 restarted alone
    assert [r.getMessage() for r in caplog.records] == ["replica group 1 restarted (1)"]
    assert groups.relay([[_end(58)], [_end(60)]], [True, True]) == []  # Ends held back
    heard: list = []
    assert groups.ended(heard.append).steps == 60  # the most steps: group 1's
    assert [e.result.steps for e in heard] == [60]  # one End, the run's


def test_groups_ending_at_the_same_step_end_the_run_with_the_lowest_ones():
    groups = _groups(None, None, None)
    ends = [_end(60), _end(60), _end(40)]
    groups.relay([[ends[0]], [ends[1]], [ends[2]]], [True, True, True])
    heard: list = []
    groups.ended(heard.append)
    assert heard == [ends[0]]  # the same steps: group 0's (equal by value: identity tells them apart)
    assert heard[0] is ends[0]


def test_a_group_lost_for_good_is_said_once_and_the_others_end_the_run(caplog):
    groups = _groups(None, _lost(1, "boom"))
    with caplog.at_level(logging.WARNING, logger="raylane"):
        groups.relay([[], [Log(rank=0, level="warning", message="x")]], [False, True])
        groups.relay([[_end(60)], []], [True, True])
    assert [r.getMessage() for r in caplog.records] == [
        "replica group 1 lost for good: training failed on rank 1: RuntimeError: boom"
    ]
    assert groups.ended(lambda e: None).steps == 60


def test_no_group_finished_fails_the_run_in_one_line_naming_each_groups_failure():
    groups = _groups(_lost(0, "boom"), _lost(0, "boom"), _lost(1, "disk"))
    groups.relay([[], [], []], [True, True, True])
    with pytest.raises(TrainingError) as raised:
        groups.ended(lambda e: None)
    assert str(raised.value) == (
        "no replica group finished: groups 0, 1: training failed on rank 0: RuntimeError: boom; "
        "group 2: training failed on rank 1: RuntimeError: disk"
    )


def test_a_run_without_an_end_and_without_a_failure_ends_with_none():
    groups = _groups(None, None)  # an autotune search's: its SearchEnd went to the listeners
    assert groups.ended(lambda e: None) is None
