"""What a run measured, as the Trainer reports it: the run's result (`_result`: throughput from
the end of the warm-up steps, memory, the layout, how it ended) and rank 0's speed over one epoch
(`_epoch_speed`), every rank's step times each window (`_rank_figures`) and the profiler's window
(`_profiling`), mixed into raylane.loop.trainer.Trainer, whose state they read."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from raylane.config import TrainSection
from raylane.loop.checkpoint.saving import Saver
from raylane.loop.data import baddata
from raylane.loop.distributed.devices import largest_memory, peak_memory_bytes, state_bytes
from raylane.loop.distributed.fsdp import Strategy
from raylane.loop.distributed.groups import backend_name
from raylane.loop.evaluation import Evaluation
from raylane.loop.observe.steptimes import StepTimes, split_rows
from raylane.loop.protocols.result import RunResult
from raylane.loop.protocols.runtime import Runtime
from raylane.loop.reporting import Reporter
from raylane.loop.steps import Throughput
from raylane.loop.stopping import StepVote

# Throughput in the result leaves out this launch's first steps (compilation, allocator and
# cache warm-up), and any before rank 0's MLflow logger has started, when the run is long
# enough to do without them.
WARMUP_STEPS = 3


class RunFigures:
    """Mixed into the Trainer: its figures, from the state it declares below (the Trainer's)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    train_cfg: TrainSection
    runtime: Runtime
    reporter: Reporter
    saver: Saver
    evaluation: Evaluation
    stops: StepVote
    step_times: StepTimes
    profiler: Any
    slowest_profiler: Callable[[], Any] | None
    strategy: Strategy
    throughput: Throughput
    step: int
    epoch: int
    data_ranks: int
    batches_per_epoch: int
    samples_per_step: int
    samples_seen_in_epoch: int
    skipped_steps: int
    checkpoint_stall_s: float
    state_bytes: int | None
    resumed_from_step: int | None
    last_checkpoint: str | None
    _warm: tuple[float, float, int] | None
    _train_started: float
    _trained_before_s: float

    def _result(self, start: tuple[float, float, int], last_step_end: float, epoch_ends: list[float]) -> RunResult:
        """The run's figures, from `start` (wall time, CPU time, step) or, when the run was long
        enough, from the end of the warm-up steps."""
        ended, ended_cpu = time.perf_counter(), time.process_time()
        if self._warm is not None and self.step - self._warm[2] >= WARMUP_STEPS:
            start = self._warm
        started, started_cpu, first_step = start
        # To the end of the last step: the end-of-run checkpoint and evaluation are not training
        # throughput (a GPT-2 save on one H100 took as long as 50 steps).
        samples_per_s = (self.step - first_step) * self.samples_per_step / max(last_step_end - started, 1e-9)
        rates = self.throughput.rates(samples_per_s, self.runtime.world_size)
        return RunResult(
            steps=self.step,
            epochs=self.epoch,
            partial_epoch=self._partial_epoch(),
            step_time_s=(last_step_end - started) / max(self.step - first_step, 1),
            samples_per_s=samples_per_s,
            tokens_per_s=rates.get("tokens_per_s"),
            mfu=rates.get("mfu"),
            train_s=ended - started,
            train_wall_s=self._trained_before_s + ended - self._train_started,
            # Every thread counted (gloo's, Ray's): much less sensitive than train_s to other
            # processes on a busy machine (B1).
            train_cpu_s=ended_cpu - started_cpu,
            checkpoint_stall_s=self.checkpoint_stall_s,
            epoch_end_s=epoch_ends,
            metrics=self.evaluation.metrics,
            memory=largest_memory(self._state_bytes(), self.device),
            strategy=self.strategy.label,
            mesh=list(self.strategy.mesh_shape),
            node_ranks=self.runtime.node_ranks,
            world_size=self.runtime.world_size,
            backend=backend_name(),
            resumed_from_step=self.resumed_from_step,
            checkpoint=self.saver.last_checkpoint or self.last_checkpoint,
            skipped_steps=self.skipped_steps,
            skipped_rows=baddata.skipped_rows(),  # what this process counted (the summary's)
            failed_checkpoints=self.saver.failed,
            preempted=self.stops.preempted,
            node_leaving=self.stops.node_leaving,
            growing=self.stops.growing,
            stop_reason=self.stops.reason() if self.stops.preempted else self.evaluation.early_stop.reason,
            early_stopped=self.evaluation.stopped and not self.stops.preempted,
        )

    def _partial_epoch(self) -> float:
        """The share of the running epoch trained, in samples over every launch of the run (the
        epoch's samples as this launch splits them); a resume that restarted the epoch (another
        world size) counts what it trained before too, so it is capped at 1."""
        epoch_samples = self.batches_per_epoch * self.train_cfg.batch_size * self.data_ranks
        return round(min(self.samples_seen_in_epoch / max(epoch_samples, 1), 1.0), 4)

    def _epoch_speed(self, start: tuple[float, int], end: float) -> dict[str, float]:
        """Rank 0's throughput over one epoch's steps, from the end of the warm-up steps when they
        fell inside it and left steps after them; no collective (the steps of DDP and FSDP end
        together on every rank, and a collective here would cost every epoch end its wait)."""
        if not self.reporter.active:
            return {}
        began, first = start
        if self._warm is not None and first < self._warm[2] < self.step:
            began, first = self._warm[0], self._warm[2]
        steps = self.step - first
        if steps <= 0:
            return {}
        elapsed = max(end - began, 1e-9)
        samples_per_s = steps * self.samples_per_step / elapsed
        return {
            "samples_per_s": samples_per_s,
            "step_time_s": elapsed / steps,
            "peak_memory_bytes": float(peak_memory_bytes(self.device)),
            "train_s": self._trained_before_s + end - self._train_started,
            **self.throughput.rates(samples_per_s, self.runtime.world_size),
        }

    def _state_bytes(self) -> int:
        if self.state_bytes is None:
            self.state_bytes = state_bytes(self.model, self.optimizer)
        return self.state_bytes

    @contextlib.contextmanager
    def _profiling(self) -> Iterator[None]:
        """The profiler's window (profile.*), on a profiled rank (or one that the step times name
        as the slowest, from then on: `_rank_figures`): its trace is written however the loop
        ends, before the last window's figures are gathered (so before rank 0 goes on). A loop
        ending out of memory leaves its memory snapshot first (profile.memory_snapshot_on_oom),
        then fails as it would without a profile."""
        if self.profiler is not None:
            self.profiler.start(self.step)
        try:
            yield
        except BaseException as exc:
            if self.profiler is not None:
                from raylane.loop.observe.profiling import is_out_of_memory  # imported already: the profiler's module

                if is_out_of_memory(exc):
                    self.profiler.out_of_memory()
            raise
        finally:
            if self.profiler is not None:
                self.profiler.close()

    def _rank_figures(self, values: list[float], *, in_loop: bool = True) -> None:
        """A window's step times from every rank (gathered on a vote): on rank 0, its aggregates
        to MLflow, and a rank it names as a straggler to the driver (once). On a rank that profiles
        itself once named the slowest (profile.ranks: `slowest`), the same naming, from the same
        figures (every rank holds them, bit for bit, after the vote's all-reduce), starts its
        profiler at its next step: no rank tells another."""
        if not values or not (self.reporter.active or self.slowest_profiler):
            return
        metrics, named = self.step_times.window(self.step, split_rows(values, self.runtime.world_size))
        if self.reporter.active:
            if metrics:
                self.reporter.log_metrics(metrics, self.step)
            for straggler in named:
                self.reporter.on_straggler(straggler.to_dict(), straggler.line())
        if in_loop and self.slowest_profiler and any(s.rank == self.runtime.rank for s in named):
            make, self.slowest_profiler = self.slowest_profiler, None  # once: a rank is named once
            self.profiler = make()
            self.profiler.start(self.step)
