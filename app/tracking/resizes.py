"""An elastic run's resizes, as the driver sees them: every (re)start of the worker group
announces its world size; one that differs from the group before it is a resize."""

from __future__ import annotations

import time
from typing import Any


class Resizes:
    """`on_event` for the driver's listeners; `resizes` for the summary and MLflow. Time lost is
    from the previous group's last event to the new group's first step: the steps redone since
    the checkpoint it resumed from are in it, as is the wait for workers."""

    def __init__(self) -> None:
        self.resizes: list[dict[str, Any]] = []
        self._world: int | None = None
        self._last_event = time.time()
        self._pending: dict[str, Any] | None = None

    def on_event(self, event: dict[str, Any]) -> None:
        kind, now = event.get("event"), time.time()
        if kind == "start":
            world = event.get("world_size")
            if self._world is not None and world is not None and world != self._world:
                self._pending = {"step": event.get("resumed_from_step") or 0, "from": self._world, "to": world,
                                 "reason": "more workers fit" if world > self._world else "a worker or node was lost",
                                 "group_lost_unix": self._last_event}
            self._world = world if world is not None else self._world
        elif kind == "first_step" and self._pending is not None:
            resize, self._pending = self._pending, None
            resize["time_lost_s"] = round(event.get("time_unix", now) - resize.pop("group_lost_unix"), 3)
            self.resizes.append(resize)
        if kind in ("progress", "checkpoint", "eval", "first_step"):
            self._last_event = now
