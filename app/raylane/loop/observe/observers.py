"""The observers a rank's Trainer holds (raylane.loop.trainer.Trainer), made outside it
(raylane.loop.run), and the one order they are told the loop's moments in (each an Observer:
raylane.loop.observe.observer). Ray-free."""

from __future__ import annotations

from dataclasses import dataclass

from raylane.loop.observe.faults import FaultPlan
from raylane.loop.observe.hangs import HangWatch
from raylane.loop.observe.observer import Observer
from raylane.loop.observe.steptimes import StepTimes


@dataclass(frozen=True)
class Observers:
    """What watches a rank's loop, made outside the Trainer: every rank's step times (None: the
    Trainer's own, timed and never reported), a torch.profiler window (profiling.StepProfiler,
    or one Deferred to the step the step times name this rank the slowest), the hang watch's
    watchdog, faults injected on purpose."""

    step_times: StepTimes | None = None
    profiler: Observer | None = None
    hang_watch: HangWatch | None = None
    faults: FaultPlan | None = None

    def in_order(self, *last: Observer) -> list[Observer]:
        """The observers told each moment, in this order: the step timer first (when it times),
        so that a fault's sleep after it is timed where a real one would be (faults: `slowdata`
        as the data's wait, `slow` as the step's compute); the profiler's step after the timer's
        end; then `last` (the Trainer's figures: the state's size measured outside the step)."""
        timed = [self.step_times] if self.step_times is not None and self.step_times.enabled else []
        return [*timed, *(o for o in (self.hang_watch, self.faults, self.profiler) if o is not None), *last]
