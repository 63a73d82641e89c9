"""How the run's workers changed, as the driver sees them: an elastic run's resizes (every
(re)start of the worker group announces its world size; one that differs from the group before it
is a resize), and a run with replica groups' heals and quorums (raylane.loop.distributed.ft)."""

from __future__ import annotations

import time
from typing import Any

from raylane.loop.protocols.events import (
    Checkpoint,
    CheckpointFailed,
    Eval,
    Event,
    FirstStep,
    Handover,
    Progress,
    ReplicaHealed,
    ReplicaQuorum,
    Start,
)


class Resizes:
    """`on_event` for the driver's listeners; `resizes` for the summary and MLflow. Time lost is
    from the previous group's last event to the new group's first step: the steps redone since
    the checkpoint it resumed from are in it, as is the wait for workers. Steps lost: how far
    the previous group had reported past that checkpoint (0 after a node's notice, whose
    checkpoint is the last step; at least that many after a loss without one)."""

    def __init__(self) -> None:
        self.resizes: list[dict[str, Any]] = []
        self._world: int | None = None
        self._last_event = time.time()
        self._pending: dict[str, Any] | None = None
        self._last_step = 0  # the furthest step the current group reported
        self._notice: str | None = None  # why the last group handed over, when it was told
        # Replica groups: heals by any group, the longest, and the fewest groups that stepped together.
        self.heals, self.longest_heal_s = 0, 0.0
        self.fewest_alive: int | None = None

    def on_event(self, event: Event) -> None:
        now = time.time()
        match event:
            case Start():
                world, resumed = event.world_size, event.resumed_from_step or 0
                if self._world is not None and world != self._world:
                    reason = "more workers fit" if world > self._world else self._notice or "a worker or node was lost"
                    self._pending = {
                        "step": resumed,
                        "from": self._world,
                        "to": world,
                        "reason": reason,
                        "steps_lost": max(self._last_step - resumed, 0),
                        "group_lost_unix": self._last_event,
                    }
                self._world = world
                self._notice, self._last_step = None, resumed
            case Handover(result=r):
                self._notice = r.stop_reason
                self._last_step = max(self._last_step, r.steps)
            case ReplicaHealed(seconds=seconds):
                self.heals, self.longest_heal_s = self.heals + 1, max(self.longest_heal_s, seconds)
            case ReplicaQuorum(alive=alive):
                self.fewest_alive = alive if self.fewest_alive is None else min(self.fewest_alive, alive)
            case FirstStep() if self._pending is not None:
                resize, self._pending = self._pending, None
                resize["time_lost_s"] = round(event.time_unix - resize.pop("group_lost_unix"), 3)
                self.resizes.append(resize)
        if isinstance(event, (Progress, Checkpoint, Eval, FirstStep, Handover)):
            self._last_event = now
        if isinstance(event, (FirstStep, Progress, Eval, Checkpoint, CheckpointFailed)):
            self._last_step = max(self._last_step, event.step)

    def replicas(self, groups: int, result: Any) -> dict[str, Any]:
        """The summary's `replicas` of a run with `groups` replica groups; `result`: the RunResult
        the launch ended with (its group's steps below full strength), None when it failed."""
        mine = (result.replicas if result is not None else None) or {}
        return {
            "groups": groups,
            "heals": self.heals,
            "longest_heal_s": round(self.longest_heal_s, 3) if self.heals else None,
            "fewest_alive": groups if self.fewest_alive is None else self.fewest_alive,
            "steps_below_full": mine.get("steps_below_full", 0),
        }
