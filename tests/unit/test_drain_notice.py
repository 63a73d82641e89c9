"""Ray's drain notice (a spot reclaim, KubeRay's pod termination, `ray drain-node`) reaches a Ray
worker's loop whatever `failure.max_failures` says. Ray Train marks every worker of the group with
the notice in any case; raylane used to read it only in a run that restarts its group, so at the
default (0) a drained node's ranks trained on until the node went. In process: the real RayRuntime
on a stand-in for Ray Train's worker context, Ray's own PreemptionInfo. The drain itself, on a
local cluster: tests/e2e/test_preemption.py (slow)."""

from __future__ import annotations

import threading
import time
import types

import pytest
from ray.train import FailureConfig, PreemptionInfo

from raylane.config import load_config
from raylane.loop import preemption
from raylane.loop.stopping import StepVote
from raylane.onray import elastic, internals, runtime
from tests.conftest import wait_for

LEAVING, STAYING = "a1b2c3d4" + "0" * 48, "e5f6a7b8" + "0" * 48


@pytest.fixture(autouse=True)
def fresh_request(monkeypatch):
    """The request is process-wide: each test starts with none, and leaves none behind."""
    monkeypatch.setattr(preemption, "_requested", threading.Event())
    monkeypatch.setattr(preemption, "_node_leaving", threading.Event())
    monkeypatch.setattr(preemption, "_reason", [])
    monkeypatch.setattr(preemption, "_explain", [])
    monkeypatch.setattr(runtime, "DRAIN_POLL_S", 0.01)


def _worker(monkeypatch, tmp_path, rank: int, *, restarts: bool) -> types.SimpleNamespace:
    """A RayRuntime for `rank` of 2 (one a node), with the context Ray Train gives its worker:
    returns that context's preemption part, which Ray's PreemptionWatcher sets (mark_preempt), and
    the runtime as its `runtime`."""
    ctx = types.SimpleNamespace(
        get_world_rank=lambda: rank,
        get_local_rank=lambda: 0,
        get_world_size=lambda: 2,
        get_storage=lambda: types.SimpleNamespace(experiment_fs_path=str(tmp_path), storage_filesystem=None),
    )
    notice = types.SimpleNamespace(preemption_info=None)
    monkeypatch.setattr(runtime.ray.train, "get_context", lambda: ctx)
    monkeypatch.setattr(
        internals, "get_train_context", lambda: types.SimpleNamespace(preemption_context=notice), raising=False
    )
    monkeypatch.setattr(runtime.RayRuntime, "_number_nodes_by_id", lambda self: [0, 1])
    notice.runtime = runtime.RayRuntime(sink=None, use_gpu=False, restarts=restarts)
    return notice


def _drain(notice: types.SimpleNamespace) -> None:
    notice.preemption_info = PreemptionInfo(
        deadline_ms=int((time.time() + 60) * 1000), preempted_node_to_ranks={LEAVING: [0]}
    )


@pytest.mark.parametrize("rank", [0, 1], ids=["on the draining node", "on another node"])
def test_at_max_failures_0_a_drain_notice_stops_every_rank_at_the_next_vote(monkeypatch, tmp_path, rank):
    """The run cannot restart: whichever rank reads the notice asks, and the step vote stops every
    rank there with a checkpoint. The cause is named for the summary, whichever rank is rank 0."""
    notice = _worker(monkeypatch, tmp_path, rank, restarts=False)
    _drain(notice)
    wait_for(preemption.requested, timeout_s=5)
    assert preemption.reason().startswith("Ray's preemption notice: node a1b2c3d4 is draining, going in ")
    assert preemption.node_leaving() == (rank == 0)


def test_rank_0_names_the_notice_when_another_rank_read_it_first(monkeypatch, tmp_path):
    """Each rank polls the notice on its own: the vote can stop the group on rank 1's request
    before rank 0 has read it. The summary (rank 0's result) still names Ray's notice, not "a stop
    request from another rank" (seen in 1 of 2 runs of the drain test on the local cluster)."""
    monkeypatch.setattr(runtime.RayRuntime, "_watch_drain", lambda self: None)  # rank 0 has not polled yet
    notice = _worker(monkeypatch, tmp_path, 0, restarts=False)
    assert preemption.reason() is None
    _drain(notice)
    assert not preemption.requested()
    stopped_by_rank_1 = StepVote(notice.runtime)  # what rank 0's result gives as the stop's reason
    assert stopped_by_rank_1.reason().startswith("Ray's preemption notice: node a1b2c3d4 is draining")


def test_a_group_that_restarts_hears_the_notice_from_the_leaving_ranks_only(monkeypatch, tmp_path):
    """With restarts (failure.max_failures, an elastic run), a vote that heard a staying rank first
    would stop the run instead of handing over without the node: only the leaving ranks ask."""
    _drain(_worker(monkeypatch, tmp_path, 1, restarts=True))
    time.sleep(0.2)  # 20 polls of the notice
    assert not preemption.requested()
    _drain(_worker(monkeypatch, tmp_path, 0, restarts=True))
    wait_for(preemption.requested, timeout_s=5)
    assert preemption.node_leaving()


def test_a_run_that_may_not_restart_gets_no_restart_from_a_preemption_either():
    """Ray retries a preemption on a budget of its own (unlimited by default): at max_failures 0 a
    notice the ranks could not honour in time would restart the group from an older checkpoint."""
    cfg = load_config("digits")
    assert cfg.failure.max_failures == 0
    assert elastic.failure_config(cfg).max_preemption_failures == 0
    default = FailureConfig().max_preemption_failures
    restarts = cfg.model_copy(update={"failure": cfg.failure.model_copy(update={"max_failures": 2})})
    assert elastic.failure_config(restarts) == FailureConfig(max_failures=2, max_preemption_failures=default)


def test_a_notice_to_every_rank_of_a_replica_group_restarts_that_group_alone(monkeypatch):
    """A drain notice to all the ranks of a run stops the run (a scheduler stopping it); to all
    the ranks of one replica group (fault_tolerance), it is that group's node leaving: the group
    hands over to a restart without the node while the other groups step on (issue 62; before,
    the group's run ended KILLED and never came back: tests/e2e/test_ft_drain.py)."""
    one_rank = types.SimpleNamespace(rank=0, world_size=1, restarts_without_leaving_nodes=True)
    preemption.request("the node is leaving", node_leaving=True)
    whole_run = StepVote(one_rank)
    assert whole_run.poll(1, save_busy=False)[0] and not whole_run.node_leaving
    for name, value in (("RAYLANE_REPLICA_GROUP", "1"), ("RAYLANE_REPLICA_GROUPS", "2")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")
    group = StepVote(one_rank)
    assert group.poll(1, save_busy=False)[0] and group.node_leaving
    assert group.reason() == "notice to 1 of 1 ranks that their node is leaving (the node is leaving)"
    no_restarts = StepVote(types.SimpleNamespace(rank=0, world_size=1, restarts_without_leaving_nodes=False))
    assert no_restarts.poll(1, save_busy=False)[0] and not no_restarts.node_leaving  # max_failures 0: it stops
