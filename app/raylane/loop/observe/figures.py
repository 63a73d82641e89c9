"""What a rank's loop measures of its own speed, as an observer the Trainer holds (`RunFigures`):
the launch's training time and throughput, from the end of the warm-up steps when the run is long
enough; rank 0's speed over each epoch; the time the loop waited on checkpoints; training seconds
over every launch of the run; the memory its model and optimizer hold. The Trainer puts them in
its result (raylane.loop.protocols.result.RunResult) beside what it knows itself (its steps, how
it ended). Ray-free; no collective but the result's memory figures (`result_figures`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from raylane.loop.distributed.devices import largest_memory, peak_memory_bytes
from raylane.loop.observe.observer import Observer
from raylane.loop.protocols.runtime import Runtime

# Throughput in the result leaves out this launch's first steps (compilation, allocator and
# cache warm-up), and any before rank 0's MLflow logger has started, when the run is long
# enough to do without them.
WARMUP_STEPS = 3


class Rates(Protocol):
    """raylane.loop.steps.Throughput: tokens per second and MFU from samples per second, and the
    share of the tokens that were data (padding aside)."""

    def rates(self, samples_per_s: float, world_size: int, share: float | None = None) -> dict[str, float]: ...

    def share(self, since: tuple[int, int] = (0, 0)) -> float | None: ...


class Teller(Protocol):
    """raylane.loop.reporting.Reporter, as the figures read it: whether this rank reports
    (`active`: each epoch's speed is rank 0's alone), and whether rank 0's MLflow logger is still
    starting (`warming`: steps taken meanwhile are no measure of training's speed)."""

    active: bool

    def warming(self) -> bool: ...


class RunFigures(Observer):
    """This launch's clock and speed (see the module's doc). `samples_per_step`: the whole group's
    samples per optimizer step; `state_size`: the bytes of this rank's model and optimizer state,
    measured once after the first step (when the optimizer's state exists)."""

    def __init__(
        self, samples_per_step: int, throughput: Rates, runtime: Runtime, teller: Teller, state_size: Callable[[], int]
    ) -> None:
        self.samples_per_step, self.throughput, self.teller = samples_per_step, throughput, teller
        self.world_size, self.device = runtime.world_size, runtime.device
        self._state_size = state_size
        self.state_bytes: int | None = None
        # Time the loop waited on checkpoints before its last step (B7): the end-of-run save,
        # which every run pays whether saves are asynchronous or not, is left out.
        self.checkpoint_stall_s = 0.0
        self.epoch_ends: list[float] = []  # seconds from the start to the end of each epoch's end work
        self.trained_before_s = 0.0  # by earlier launches of the run (from its checkpoint)
        # (wall time, process CPU time, step): this launch's start, and the end of its warm-up steps
        self.started = (time.perf_counter(), time.process_time(), 0)
        self.warm: tuple[float, float, int] | None = None

    # -- the moments -----------------------------------------------------------------------------

    def on_train_start(self, step: int) -> None:
        self.started = (time.perf_counter(), time.process_time(), step)
        self.warm, self.epoch_ends = None, []

    def on_step_end(self, step: int) -> None:
        if self.state_bytes is None:  # optimizer state exists from the first step on
            self.measure_state()
        if self.warm is None and step - self.started[2] >= WARMUP_STEPS and not self.teller.warming():
            self.warm = (time.perf_counter(), time.process_time(), step)

    def on_epoch_end(self, epoch: int) -> None:
        self.epoch_ends.append(round(time.perf_counter() - self.started[0], 4))

    # -- what the Trainer asks ---------------------------------------------------------------------

    @contextlib.contextmanager
    def checkpoint_wait(self, counted: bool = True) -> Iterator[None]:
        """A wait of the loop on a checkpoint (a save, its staging, its commit): counted as a
        stall unless it is the end-of-run save (`counted` False)."""
        blocked = time.perf_counter()
        try:
            yield
        finally:
            if counted:
                self.checkpoint_stall_s += time.perf_counter() - blocked

    def measure_state(self) -> int:
        if self.state_bytes is None:
            self.state_bytes = self._state_size()
        return self.state_bytes

    def train_s_total(self) -> float:
        """Training seconds over every launch of the run (a time-to-target sweep ranks by it)."""
        return self.trained_before_s + time.perf_counter() - self.started[0]

    def epoch_speed(self, start: tuple[float, int], end: float, step: int) -> dict[str, float]:
        """Rank 0's throughput over one epoch's steps (`start`: its start's time and step; `end`:
        its last step's end; `step`: the steps taken), from the end of the warm-up steps when they
        fell inside it and left steps after them; no collective (the steps of DDP and FSDP end
        together on every rank, and a collective here would cost every epoch end its wait)."""
        if not self.teller.active:
            return {}
        began, first = start
        if self.warm is not None and first < self.warm[2] < step:
            began, first = self.warm[0], self.warm[2]
        steps = step - first
        if steps <= 0:
            return {}
        elapsed = max(end - began, 1e-9)
        samples_per_s = steps * self.samples_per_step / elapsed
        return {
            "samples_per_s": samples_per_s,
            "step_time_s": elapsed / steps,
            "peak_memory_bytes": float(peak_memory_bytes(self.device)),
            "train_s": self.trained_before_s + end - self.started[0],
            **self.throughput.rates(samples_per_s, self.world_size),
        }

    def result_figures(self, step: int, last_step_end: float) -> dict[str, Any]:
        """Collective (the memory figures, the largest over the ranks). The result's figures of
        this launch, to `step`, from its start or, when the run was long enough, from the end of
        the warm-up steps: to the end of the last step (`last_step_end`), since the end-of-run
        checkpoint and evaluation are not training throughput (a GPT-2 save on one H100 took as
        long as 50 steps)."""
        ended, ended_cpu = time.perf_counter(), time.process_time()
        start = self.warm if self.warm is not None and step - self.warm[2] >= WARMUP_STEPS else self.started
        started, started_cpu, first_step = start
        samples_per_s = (step - first_step) * self.samples_per_step / max(last_step_end - started, 1e-9)
        share = self.throughput.share()  # this launch's, warm-up included: padding is the data's, not the clock's
        rates = self.throughput.rates(samples_per_s, self.world_size, share)
        return {
            "step_time_s": (last_step_end - started) / max(step - first_step, 1),
            "samples_per_s": samples_per_s,
            "tokens_per_s": rates.get("tokens_per_s"),
            "real_tokens_per_s": rates.get("real_tokens_per_s"),
            "packing_efficiency": share,
            "mfu": rates.get("mfu"),
            "train_s": ended - started,
            "train_wall_s": self.trained_before_s + ended - self.started[0],
            # Every thread counted (gloo's, Ray's): much less sensitive than train_s to other
            # processes on a busy machine (B1).
            "train_cpu_s": ended_cpu - started_cpu,
            "checkpoint_stall_s": self.checkpoint_stall_s,
            "epoch_end_s": list(self.epoch_ends),
            "memory": largest_memory(self.measure_state(), self.device),
        }
