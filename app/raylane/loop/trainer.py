"""The training loop, in the tutorial's shape (`run_step`, `_run_epoch`, `_save_checkpoint`,
`train`). Model, data, optimizer and what it is composed of (`Parts`) and watched by (`Observers`)
are built outside and passed in (raylane.loop.run.build_trainer); it never imports Ray.

Collectives happen only at fixed steps (the step-boundary vote, checkpoints, evaluation), so every
rank calls them in the same order."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from raylane.config import BaseConfig
from raylane.loop import preemption
from raylane.loop.checkpoint.saving import Saver
from raylane.loop.checkpoint.state import scheduler_state_for
from raylane.loop.data import baddata
from raylane.loop.data.loader import EpochData, fingerprint
from raylane.loop.distributed.devices import Precision, reset_peak_memory, state_bytes
from raylane.loop.distributed.fsdp import Strategy, no_gradient_sync
from raylane.loop.distributed.ft import OneReplica
from raylane.loop.distributed.groups import backend_name, node_names
from raylane.loop.distributed.layout import Layout
from raylane.loop.distributed.pipeline_parallel import PipelineModel
from raylane.loop.evaluation import EvalSets, Evaluation
from raylane.loop.observe.figures import RunFigures
from raylane.loop.observe.observer import observing, watching
from raylane.loop.observe.observers import Observers
from raylane.loop.observe.steptimes import StepTimes
from raylane.loop.optim import Schedule
from raylane.loop.protocols.batches import Forward
from raylane.loop.protocols.hooks import Hooks
from raylane.loop.protocols.result import RunResult
from raylane.loop.protocols.runtime import Runtime
from raylane.loop.reporting import Reporter
from raylane.loop.steps import (
    MetricsWindow,
    Throughput,
    clip_gradients,
    last_step,
    partial_epoch,
    plain_parameters,
    plan_steps,
    resumed_position,
    step_groups,
)
from raylane.loop.stopping import StepVote
from raylane.version import __version__

log = logging.getLogger("raylane")
# A failing run waits this long at most for the save in flight: a peer that died never commits it.
FAILED_RUN_SAVE_WAIT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Parts:
    """What the loop runs besides its model, batches and optimizer, built outside with them: how
    a batch goes through the model (`forward`), the layout (`strategy`; None: one process or
    DDP), the learning-rate schedule, the rates throughput is counted in, the held-out sets, the
    pipeline's hooks, the process group the step-boundary vote runs on (None: the default), the
    replica groups (raylane.loop.distributed.ft)."""

    forward: Forward
    strategy: Strategy | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    throughput: Throughput = dataclasses.field(default_factory=Throughput)
    evaluator: EvalSets | None = None
    hooks: Sequence[Any] = ()
    vote_group: Any = None
    replicas: OneReplica = dataclasses.field(default_factory=OneReplica)


class Trainer:
    """One rank's training, as a recipe: each epoch's batches, grouped into optimizer steps
    (`run_step`); after each step, the train metrics of its window, the hooks, and an evaluation
    and a checkpoint when due; after each epoch, its evaluation and its checkpoint; at the end,
    the run's last evaluation and its result.

    What it is composed of is built outside (raylane.loop.run.build_trainer): the `saver` decides
    when a checkpoint is due (`Saver.due`) and writes it; the `parts`' evaluator measures the
    held-out sets, inside an `Evaluation` that reports, counts for early stopping and calls the
    hooks; the `reporter` tells the driver (rank 0). `config` is the run's, stored in every
    checkpoint. What it measures are objects it holds, each told the loop's moments through one
    interface (raylane.loop.observe.observer): the `observers`, and its own figures (`figures`:
    its speed, for its result). Progress (epoch, step, batch in the epoch) is saved in every
    checkpoint, and `resume` continues at exactly the next batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        train_data: EpochData,
        optimizer: torch.optim.Optimizer,
        parts: Parts,
        *,
        config: BaseConfig,
        runtime: Runtime,
        saver: Saver,
        reporter: Reporter,
        observers: Observers | None = None,
    ) -> None:
        self.model, self.train_data, self.optimizer, self.scheduler = model, train_data, optimizer, parts.scheduler
        # Walking the module tree costs ~70 us a step on a small model (7% of a digits step on one
        # CPU core): the parameters are fixed once parallelized, and loads copy into them in place.
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._plain_grads = plain_parameters(self._params)
        self.forward, self.saver, self.runtime, self.reporter = parts.forward, saver, runtime, reporter
        self.train_cfg, self.log_every_n_steps = config.train, config.mlflow.log_every_n_steps
        self.timeout_s, self.config = config.dist.timeout_s, config.model_dump(mode="json")
        self.device = runtime.device
        self.throughput = parts.throughput
        self.accum = self.train_cfg.grad_accum_steps
        self.strategy = parts.strategy or Strategy(Layout.data_parallel_of("ddp", runtime.world_size))
        self.precision = Precision(self.train_cfg.precision, self.strategy.name, self.device)
        self.scaler = self.precision.scaler
        self.stops = StepVote(runtime, parts.vote_group)
        self.replicas = parts.replicas  # a step not committed is not counted; a heal moves the position
        # A forward in training mode may update buffers (BatchNorm's statistics) that a save in
        # flight is still copying; parameters and optimizer state change only in the step.
        self._forward_writes_state = any(True for _ in model.buffers())
        self._saved_step: int | None = None
        self._init_progress(train_data, self.strategy.data_parallel * self.replicas.count)  # every group's
        self._init_observers(observers or Observers())
        # Under pipeline parallelism: this rank's stages, run by their schedule (raylane.loop.distributed.pipeline_parallel).
        self.pipeline = model.pipeline if isinstance(model, PipelineModel) else None
        self.hooks = Hooks(parts.hooks, self)
        self.evaluation = Evaluation(parts.evaluator, model, reporter, self.train_cfg, self.hooks, self._keep_failed)
        saver.on_committed = lambda step, where: self.hooks.call("on_checkpoint", step=step, checkpoint=where)
        self.replicas.carry(self.state_dict, self.load_state_dict)  # what a healing group copies besides the weights
        self.hooks.call("setup")  # before a resume loads the hooks' state into what setup made

    def _init_observers(self, observers: Observers) -> None:
        # Every rank's step times (raylane.loop.observe.steptimes): timed, reported where made so.
        self.step_times = observers.step_times or StepTimes(self.log_every_n_steps, 1.5, 3, active=False)
        observers = dataclasses.replace(observers, step_times=self.step_times)
        self.timer = self.step_times.timer  # its marks inside a step (run_step)
        self.faults = observers.faults  # also inside a step: a loss made NaN on purpose
        state_size = functools.partial(state_bytes, self.model, self.optimizer)
        self.figures = RunFigures(self.samples_per_step, self.throughput, self.runtime, self.reporter, state_size)
        self.observers = observers.in_order(self.figures)
        # Bound once: a step calls only the observers that watch each of its moments.
        self._on_step_start = watching(self.observers, "on_step_start")
        self._on_batch = watching(self.observers, "on_batch")
        self._on_step_end = watching(self.observers, "on_step_end")

    def _init_progress(self, train_data: EpochData, data_ranks: int) -> None:
        # Progress, saved in every checkpoint: resume continues at exactly the next batch. Samples
        # count by data-parallel rank: a tensor-parallel group's ranks read the same batches.
        self.data_ranks = data_ranks
        self.epoch = 0
        self.step = 0
        self.batch_in_epoch = 0
        # Samples the whole group trained in this epoch, over every launch: the epoch's fraction
        # in samples never goes back when a resume changes the world size or the batch size.
        self.samples_seen_in_epoch = 0
        self.resumed_from_step: int | None = None
        self.steps_per_epoch, self.total_steps = plan_steps(train_data, self.train_cfg)
        self.batches_per_epoch = train_data.batches_in_epoch(0)  # of the epoch running; see _run_epoch
        self.data_fingerprint = fingerprint(train_data)  # in every checkpoint: a resume on other data is told
        self.group_batch = self.train_cfg.batch_size * data_ranks  # the group's samples per micro-batch
        self.samples_per_step = self.group_batch * self.accum
        # Rank 0's throughput over the last epoch's steps, sent with its checkpoint (sweeps rank by it).
        self.speed_metrics: dict[str, float] = {}
        self.skipped_steps = 0
        self.last_checkpoint: str | None = None
        # Newer checkpoints the resume passed over (damaged, unfinished): {"path", "reason"}.
        self.skipped_checkpoints: list[dict[str, str]] = list(self.runtime.store.skipped)
        self.resumed_from: str | None = None  # the checkpoint loaded, by name
        self.resumed_layout: str | None = None  # the line a resume at another layout says
        self.window = MetricsWindow(self.device, self.model)

    # -- the loop ------------------------------------------------------------------------------

    def run_step(self, micro_batches: list[Any]) -> torch.Tensor | None:
        """One optimizer step over its micro-batches, as training takes it (autotune times it): the
        mean loss, or None when a non-finite update was skipped. Gradients are reduced on the last
        micro-batch only; the step count and checkpoints are the caller's. Under pipeline parallelism
        the schedule runs them, and the last stage's loss reaches every stage with the gradient norm
        (one all-reduce, which the NaN vote and the clipping of parameters over stages need anyway)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.throughput.count(micro_batches)  # on the host, before they move: padding's share
        self.replicas.begin(self.step)
        if self._forward_writes_state:
            self._wait_for_staging()
        n = len(micro_batches)
        losses, carried = [], None
        if self.pipeline is not None:
            with self.precision.autocast():
                carried = self.pipeline.train_step(micro_batches)  # the batches' losses summed (last stage)
        for i, batch in enumerate(micro_batches if carried is None else ()):
            last = i == n - 1
            sync = contextlib.nullcontext() if last else no_gradient_sync(self.model)
            with sync, self.precision.autocast(), self.strategy.step_context():
                loss, metrics = self.forward.run(self.model, batch)
                if metrics:
                    self.window.step_metrics.add(metrics)
                if self.faults:
                    loss = self.faults.corrupt_loss(self.step + 1, loss)
                scaled = loss / n if n > 1 else loss  # each op dispatched costs µs on tiny steps
                if last:
                    self.timer.arrive()  # this backward waits for the last rank at the gradient sync
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            losses.append(loss.detach())
        self.timer.computed()
        self.replicas.reduce()
        if not self.replicas.commit():  # a replica group failed in the step: no group takes it
            return None
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if not self._clip_gradients(carried) and not self.scaler:  # the scaler skips such steps itself
            if self.train_cfg.on_nan == "stop":
                raise FloatingPointError(f"non-finite loss or gradients at step {self.step + 1} (train.on_nan: stop)")
            self.skipped_steps += 1
            return None
        self._wait_for_staging()
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        if carried is not None:
            return carried / n
        return losses[0] if n == 1 else torch.stack(losses).mean()

    def _wait_for_staging(self) -> None:
        """Before the state changes: the copy a save in flight is taking must be complete."""
        if self.saver.staging():
            with self.figures.checkpoint_wait():
                self.saver.wait_staged()

    def _clip_gradients(self, carry: torch.Tensor | None = None) -> bool:
        """The global gradient norm (over every shard under FSDP, every stage of a pipeline),
        clipped to train.grad_clip_norm; False when it is not finite. The gradients are already
        reduced, so a NaN on any rank is a NaN on every rank: all ranks reach the same verdict.
        `carry` (a pipeline's loss): summed over the pipeline's stages in the same collective."""
        upcoming = self.step + 1  # the step being taken: its norm is logged if the window ends there
        wanted = upcoming % self.log_every_n_steps == 0 or upcoming >= self.total_steps
        clipped = clip_gradients(
            self._params,
            self.train_cfg.grad_clip_norm,
            plain=self._plain_grads,
            norm_wanted=wanted,
            across=self.pipeline.group if self.pipeline is not None else None,
            carry=carry,
        )
        if clipped is None:
            return True
        if clipped[0] is not None:
            self.window.grad_norm = clipped[0].detach()
        return clipped[1]

    def _run_epoch(self, epoch: int) -> None:
        self.model.train()
        batches = self._batches(epoch)
        again: list[Any] = []  # a step no replica group took: its batches are taken again
        while True:
            for watch in self._on_step_start:
                watch(self.step + 1)
            if not (micro_batches := again or next(batches, [])):
                break
            for watch in self._on_batch:
                watch(self.step + 1)
            loss = self.run_step(micro_batches)
            if not self.replicas.committed:
                again = micro_batches
                continue
            again = []
            self.step += 1
            for watch in self._on_step_end:
                watch(self.step)
            self.batch_in_epoch += len(micro_batches)
            self.samples_seen_in_epoch += len(micro_batches) * self.group_batch
            if self.replicas.healed():  # the step was taken at a peer's position: go on from there
                epoch, batches = self.epoch, self._batches(self.epoch)
            self.window.add(loss)
            self.reporter.on_step(epoch=epoch, step=self.step, first=self.step == (self.resumed_from_step or 0) + 1)
            logged = self._log_train_metrics() if self.step % self.log_every_n_steps == 0 else {}
            if self.hooks:
                self._wait_for_staging()  # a skipped step did not wait, and a hook may change its saved state
                self.hooks.call("on_step_end", metrics=logged)
            epoch_end = self.batch_in_epoch >= self.batches_per_epoch  # evaluated by train(), with the epoch's
            if not epoch_end:  # before the checkpoint due at this step
                self.evaluation.at_step(self.step, self.epoch, epoch_end=False)
            # The last batch of an epoch, or of the run, is saved by train(), after its evaluation.
            last_batch = epoch_end or self.step >= self.total_steps
            if not last_batch and self.saver.due(self.step, epoch_end=False, stopping=False):
                self._save_checkpoint()
            if self._over() or (self.stops.due(self.step) and self._step_boundary()):
                break

    def _batches(self, epoch: int) -> Any:
        """`epoch`'s optimizer steps' micro-batches, from the position the loop is at."""
        self.batches_per_epoch = self.train_data.batches_in_epoch(epoch)
        self.train_data.set_epoch(epoch, skip_batches=self.batch_in_epoch)
        return step_groups(self.train_data, self.accum)

    def _over(self) -> bool:
        """The loop ends: its last step is taken, the group stops, or early stopping ended the run."""
        return self.step >= self.total_steps or self.stops.preempted or self.evaluation.stopped

    def _step_boundary(self) -> bool:
        """The vote every rank takes at the same step; True when the loop must stop now."""
        due = self.step_times.due(self.step)  # the same on every rank: a window's figures ride on this vote
        stop, committed = self.stops.poll(self.step, self.saver.busy(), self.step_times.take(self.step) if due else ())
        if due:
            self.step_times.gathered(self.step, self.stops.gathered, self.runtime.world_size)
        if self.saver.unsettled() and committed:  # committed on every rank: only its outcome is left
            with self.figures.checkpoint_wait():
                self.saver.settle()
        return stop

    def _log_train_metrics(self, until: float | None = None) -> dict[str, float]:
        """Rank 0's own training loss, as Lightning logs it by default: an all-reduce here would
        cost as much as the vote, every few steps (the held-out metrics are exact over all ranks).
        Returns what was logged ({} on other ranks)."""
        metrics: dict[str, float] = {}
        if self.reporter.active:
            lr = float(self.optimizer.param_groups[0]["lr"])
            metrics = self.window.metrics(self.samples_per_step, lr, self.throughput, self.runtime.world_size, until)
            self.reporter.on_train_metrics(self.step, metrics)
        self.window.reset()
        return metrics

    def _save_checkpoint(self) -> None:
        if self._saved_step == self.step or not self.replicas.leads():  # one group writes the run's
            return
        with self.figures.checkpoint_wait(counted=self.step < self.total_steps):
            self.saver.save(self.model, self.optimizer, self.state_dict(), hooks=self.hooks.state_dict())
        self._saved_step = self.step

    def train(self) -> RunResult:
        """Train from where the run is (step 0, or the checkpoint loaded) to its last step or a
        stop; returns the run's result (rank 0's with what the reporter adds)."""
        self._announce()
        reset_peak_memory(self.device)
        self.stops.start(self.step)
        if self.step_times.enabled:  # one all-gather of the nodes' names, once, before the first step
            self.step_times.start(self.step, node_names(self.stops.vote.group))
        with (
            observing(self.observers, self.step),  # a profiler's trace written before the last gather
            preemption.armed(),
            self.replicas.joined(self.step),  # from the step resumed at: only a peer ahead heals this group
            self.saver.settled_on_failure(min(self.timeout_s, FAILED_RUN_SAVE_WAIT_S)),
        ):
            last_step_end = self.figures.started[0]
            while not self._over():
                epoch_start = (time.perf_counter(), self.step)
                self._run_epoch(self.epoch)
                last_step_end = self.step_clock()
                epoch_ended = self.batch_in_epoch >= self.batches_per_epoch  # not a max_steps stop or a stop
                if epoch_ended:
                    self._end_epoch(epoch_start, last_step_end)
                # The end, or a stop (an early one too), always saves: mid-epoch, or at an epoch
                # end no checkpoint was due at.
                stopping = self._over() or not epoch_ended
                if self.saver.due(self.step, epoch_end=epoch_ended, stopping=stopping, epochs=self.epoch):
                    self._save_checkpoint()
                if epoch_ended:
                    for observer in self.observers:
                        observer.on_epoch_end(self.epoch - 1)
            self.saver.settle()  # a save in flight is committed before the run ends or stops
            self.saver.close()
        if self.step_times.enabled:  # the last window's: after the loop
            taken = self.step_times.take(self.step)
            self.step_times.gathered(self.step, self.stops.gather(taken), self.runtime.world_size, in_loop=False)
        self.stops.close()
        if self.window.loss_count:
            self._log_train_metrics(until=last_step_end)  # not the end-of-run save and evaluation
        if not self.stops.preempted:  # a stopped run is not over: its last evaluation comes at its end
            self.evaluation.last(self.step, self.epoch, self.batch_in_epoch)
        return self.reporter.on_end(self._result(last_step_end))

    def _result(self, last_step_end: float) -> RunResult:
        """The run's result: what the loop knows of its end, and its figures (a collective); on
        rank 0, the stragglers named and every rank's step times."""
        return RunResult(
            steps=self.step,
            epochs=self.epoch,
            partial_epoch=partial_epoch(self.samples_seen_in_epoch, self.batches_per_epoch * self.group_batch),
            **self.figures.result_figures(self.step, last_step_end),
            metrics=self.evaluation.metrics,
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
            stragglers=self.step_times.stragglers() if self.reporter.active else None,
            rank_times=self.step_times.table.rows() if self.reporter.active else None,
            experts=self.window.run_experts(),  # every rank's, summed: a collective
        )

    def _announce(self) -> None:
        self.reporter.on_start(
            total_steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch,
            max_epochs=self.train_cfg.epoch_limit,
            world_size=self.runtime.world_size,
            resumed_from_step=self.resumed_from_step,
            resumed_from=self.resumed_from,
            resumed_layout=self.resumed_layout,
            skipped_checkpoints=self.skipped_checkpoints,
            strategy=self.strategy.label,
            strategy_reason=self.strategy.reason,
            strategy_tags=self.strategy.tags(),
        )

    def _end_epoch(self, start: tuple[float, int], last_step_end: float) -> None:
        """The epoch's throughput and, when due, its evaluation; then the next epoch's position."""
        self.speed_metrics = self.figures.epoch_speed(start, last_step_end, self.step)
        self.evaluation.at_step(self.step, self.epoch, epoch_end=True)
        self.epoch += 1
        self.batch_in_epoch = self.samples_seen_in_epoch = 0

    def _keep_failed(self, epoch_end: bool) -> None:
        """The step an evaluation failed at, saved before its error ends the run; at an epoch's
        end, as the next epoch's start (a resume does not train the ended epoch again)."""
        if epoch_end:
            self.epoch, self.batch_in_epoch, self.samples_seen_in_epoch = self.epoch + 1, 0, 0
        self._save_checkpoint()
        self.saver.settle()

    def step_clock(self) -> float:
        """Now, once the device has finished the steps queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "batch_in_epoch": self.batch_in_epoch,
            # The position in samples of the whole group: what a resume on another world size
            # continues from when the global batch is held (train.global_batch).
            "samples_in_epoch": self.batch_in_epoch * self.group_batch,
            "samples_seen_in_epoch": self.samples_seen_in_epoch,
            "samples_per_step": self.samples_per_step,
            # Training seconds over every launch of the run (a time-to-target sweep ranks by it).
            "train_s_total": self.figures.train_s_total(),
            "global_order": self.train_cfg.global_batch is not None,
            "world_size": self.runtime.world_size,
            "data_ranks": self.data_ranks,
            "layout": self.strategy.layout.record(),  # the manifest's record of it
            "data": self.data_fingerprint,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            **self.evaluation.state_dict(self.step),  # eval_metrics (for checkpoint.keep_best), early_stopping
            "speed_metrics": self.speed_metrics if self.evaluation.step == self.step else None,
            "config": self.config,
            "raylane_version": __version__,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.step = int(state["step"])
        self.batch_in_epoch, self.samples_seen_in_epoch, line = resumed_position(
            state, self.train_cfg, self.data_ranks, self.samples_per_step, self.data_fingerprint
        )
        if line and self.runtime.rank == 0:
            log.warning("%s", line)
        self.figures.trained_before_s = float(state.get("train_s_total") or 0.0)
        self.total_steps = last_step(
            self.train_data, self.train_cfg, epoch=self.epoch, batch_in_epoch=self.batch_in_epoch, step=self.step
        )
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(scheduler_state_for(state["scheduler"], self.optimizer))
        if isinstance(self.scheduler, Schedule):  # raylane's schedule ends there too
            self.scheduler.set_total_steps(self.total_steps)
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        self.evaluation.load_state_dict(state, self.step)
        self.hooks.load_state_dict(state.get("hook_states") or {})
        self.resumed_from_step = self.step

    def resume(self, state: dict[str, Any], *, checkpoint: str, name: str, layout_line: str | None) -> None:
        """At the step of `checkpoint`, whose `state` the model and optimizer hold already: its
        progress loaded, and what the start says of it (`name`: the checkpoint as the driver
        names it; `layout_line`: the line a resume at another layout says, or None)."""
        self.load_state_dict(state)
        self.last_checkpoint, self.resumed_from, self.resumed_layout = checkpoint, name, layout_line
