"""A run's start-up, phase by phase: when each phase ended, as wall-clock (unix) times.

Unix times, because the phases end in several processes (the driver, Ray Train's controller,
rank 0's worker) that share a clock on one machine. The summary gives them as seconds since the
launch (`timing.startup`, see `StartupTimes.seconds`). Each phase costs one time.time(): nothing
here runs per step. Neither torch nor Ray is imported: the driver marks its phases before either
is loaded. On a rank: the phases marked as they end, which rank 0 sends with its start and
first-step events (`with_phases`), the first batch's among them (`FirstBatchClock`)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from raylane.loop.protocols.events import Event, FirstStep, Start, Startup

# In the order they end on Ray (without Ray, the process group comes before tracking:
# TORCHRUN_PHASES). On Ray the worker's process may also start before the controller: a raylet
# keeps idle worker processes ready and hands one to the actor.
PHASES = (
    "launch",  # the launching process started: `raylane`, or torchrun's agent above this rank
    "rank_process",  # torchrun: this rank's process started
    "driver_imports",  # the driver's imports and config done (raylane.driver.train entered)
    "ray_init",  # Ray: ray.init returned (an embedded cluster started, or a running one joined)
    "tracking",  # the MLflow run opened (started beside ray.init; waited for here)
    "fit",  # Ray: Ray Train imported and the trainer built; TorchTrainer.fit() called
    "controller",  # Ray: Ray Train's controller actor running
    "worker_process",  # Ray: rank 0's worker process started
    "process_group",  # the ranks' process group initialized (torchrun: by the driver, first)
    "worker_imports",  # rank 0 has imported torch and raylane's loop and entered it
    "pipeline",  # model and data built (the pipeline's build(cfg))
    "parallelize",  # the model wrapped (DDP, FSDP, ...)
    "ready",  # optimizer, loaders, side groups, resume: the Trainer about to train
    "first_batch",  # rank 0's first batch loaded
    "first_step",  # rank 0's first optimizer step done
)
# Without Ray (torchrun, or one process: no rank_process then).
TORCHRUN_PHASES = (
    "launch",
    "rank_process",
    "driver_imports",
    "process_group",
    "tracking",
    "worker_imports",
    "pipeline",
    "parallelize",
    "ready",
    "first_batch",
    "first_step",
)


def process_start_unix(pid: int | None = None) -> float | None:
    """When a process (this one by default) started, on the wall clock; None where it cannot be
    told. psutil's create_time adds the boot time in whole seconds (the kernel's btime): its start
    since boot, that boot time taken back out, against the time since boot now (CLOCK_BOOTTIME,
    the uptime's clock) keeps it to the clock tick."""
    import psutil

    try:
        for _ in range(3):  # a clock stepped between the two boot times: asked again
            boot = psutil.boot_time()
            since_boot = psutil.Process(pid).create_time() - boot
            if psutil.boot_time() == boot:
                break
        uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    except (psutil.Error, OSError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME (not Linux)
        return None
    return time.time() - uptime + since_boot


def under_torchrun_agent() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


class StartupTimes:
    """The phases one run's driver sees: its own, marked here, and those its events carry
    (Ray's controller; rank 0's worker, on its first start only: a restart is not start-up)."""

    def __init__(self) -> None:
        self.unix: dict[str, float] = {}
        if under_torchrun_agent():
            self._set("launch", process_start_unix(os.getppid()))
            self._set("rank_process", process_start_unix())
        else:
            self._set("launch", process_start_unix())
        self._starts = 0
        self.processes: dict[str, float] = {}  # actor -> when its process started (Startup.processes)

    def _set(self, phase: str, unix: float | None) -> None:
        if unix is not None:
            self.unix.setdefault(phase, unix)

    def mark(self, phase: str) -> None:
        self._set(phase, time.time())

    def on_event(self, event: Event) -> None:
        match event:
            case Startup():
                self._set_all(event.phases)
                for actor, unix in event.processes.items():
                    self.processes.setdefault(actor, unix)  # a restart's are not start-up
            case Start():
                self._starts += 1
                if self._starts == 1:
                    self._set_all(event.startup)
            case FirstStep() if self._starts == 1:
                self._set_all(event.startup)
                self._set("first_step", event.time_unix)

    def _set_all(self, phases: dict[str, float]) -> None:
        for phase, unix in phases.items():
            self._set(phase, unix)

    def warm_actors(self) -> dict[str, bool]:
        """Each actor that said when its process started: whether that was before this run was
        launched, so on a warm worker ({} off Ray). Not `ray_init`: an embedded cluster starts
        workers of its own within ray.init, and a sink landing on one is no warm start."""
        launched = self.unix.get("launch")
        if launched is None or "ray_init" not in self.unix:
            return {}
        return {actor: unix < launched for actor, unix in sorted(self.processes.items())}

    def seconds(self) -> dict[str, float]:
        """Each phase seen: seconds since the launch (or since the first phase seen, where the
        launch is unknown)."""
        if not self.unix:
            return {}
        origin = self.unix.get("launch", min(self.unix.values()))
        order = PHASES if "ray_init" in self.unix else TORCHRUN_PHASES
        return {p: round(self.unix[p] - origin, 3) for p in order if p in self.unix}


def with_phases(publish: Callable[[Event], None], phases: dict[str, float]) -> Callable[[Event], None]:
    """`publish`, with a rank's start-up `phases` so far on the start and first-step events (the
    start event leaves before the first batch is read)."""

    def send(event: Event) -> None:
        if isinstance(event, (Start, FirstStep)):
            event = dataclasses.replace(event, startup=dict(phases))
        publish(event)

    return send


class FirstBatchClock:
    """The train data, timing rank 0's first batch into `phases`. The first epoch's iterator is
    the loader's own behind a C-level chain; later epochs get the loader's own iterator untouched."""

    def __init__(self, data: Any, phases: dict[str, float]) -> None:
        self._data, self._phases = data, phases

    def __getattr__(self, name: str) -> Any:
        return getattr(self._data, name)

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self._data)
        if "first_batch" in self._phases:
            return batches
        try:
            first = next(batches)
        except StopIteration:
            return iter(())
        self._phases["first_batch"] = time.time()
        return itertools.chain((first,), batches)
