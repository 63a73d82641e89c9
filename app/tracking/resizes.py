"""An elastic run's resizes, as the driver sees them: every (re)start of the worker group
announces its world size; one that differs from the group before it is a resize."""

from __future__ import annotations

import time
from typing import Any


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

    def on_event(self, event: dict[str, Any]) -> None:
        kind, now = event.get("event"), time.time()
        if kind == "start":
            world = event.get("world_size")
            resumed = event.get("resumed_from_step") or 0
            if self._world is not None and world is not None and world != self._world:
                reason = ("more workers fit" if world > self._world else
                          self._notice or "a worker or node was lost")
                self._pending = {"step": resumed, "from": self._world, "to": world, "reason": reason,
                                 "steps_lost": max(self._last_step - resumed, 0), "group_lost_unix": self._last_event}
            self._world = world if world is not None else self._world
            self._notice, self._last_step = None, resumed
        elif kind == "handover":
            self._notice = event["result"].get("stop_reason")
            self._last_step = max(self._last_step, event["result"].get("steps") or 0)
        elif kind == "first_step" and self._pending is not None:
            resize, self._pending = self._pending, None
            resize["time_lost_s"] = round(event.get("time_unix", now) - resize.pop("group_lost_unix"), 3)
            self.resizes.append(resize)
        if kind in ("progress", "checkpoint", "eval", "first_step", "handover"):
            self._last_event = now
        if isinstance(event.get("step"), int):
            self._last_step = max(self._last_step, event["step"])
