"""What the summary says of a run with replica groups (issue 62, item 4): the heals the driver
heard from any group, the longest, the fewest groups that stepped together, and the steps the
finished group took below full strength; bounded (one object, not one entry per rank or heal)."""

from __future__ import annotations

from types import SimpleNamespace

from raylane.loop.protocols.events import ReplicaHealed, ReplicaQuorum
from raylane.results import TrainSummary
from raylane.tracking.resizes import Resizes


def test_the_driver_counts_heals_and_quorums_from_every_group():
    seen = Resizes()
    for event in (
        ReplicaQuorum(step=0, alive=2, groups=2),
        ReplicaQuorum(step=21, alive=1, groups=2),  # group 1 lost
        ReplicaHealed(group=1, step=46, from_step=0, seconds=0.42),
        ReplicaQuorum(step=46, alive=2, groups=2),
        ReplicaHealed(group=0, step=50, from_step=49, seconds=0.11),
    ):
        seen.on_event(event)
    # The finished group's own count of steps below full strength (RunResult.replicas).
    result = SimpleNamespace(replicas={"groups": 2, "heals": 0, "steps_below_full": 25})
    assert seen.replicas(2, result) == {
        "groups": 2,
        "heals": 2,
        "longest_heal_s": 0.42,
        "fewest_alive": 1,
        "steps_below_full": 25,
    }
    assert seen.replicas(2, None)["steps_below_full"] == 0  # a failed run: no result
    summary = TrainSummary(status="FINISHED", run_name="r", replicas=seen.replicas(2, result))
    assert summary.replicas is not None and summary.replicas.heals == 2
    assert Resizes().replicas(3, None) == {
        "groups": 3,
        "heals": 0,
        "longest_heal_s": None,
        "fewest_alive": 3,  # no quorum heard of fewer
        "steps_below_full": 0,
    }


def test_the_outcome_names_the_runs_workers_and_its_groups():
    from raylane.tracking.progress import outcome_text

    replicas = {"groups": 2, "heals": 1, "longest_heal_s": 0.3, "fewest_alive": 1, "steps_below_full": 20}
    summary = TrainSummary(status="FINISHED", run_name="r", steps=60, epochs=1, world_size=4, replicas=replicas)
    assert "steps:         60 in 1 epoch on 4 workers in 2 replica groups" in outcome_text(summary, "ui", None)
