"""The training loop, in the tutorial's shape (`_run_batch`, `_run_epoch`, `_save_checkpoint`,
`train`). Model, data and optimizer are built outside and passed in; it never imports Ray.

Collectives happen only at fixed steps (metric reductions every `mlflow.log_every_n_steps`,
checkpoints, evaluation), so every rank calls them in the same order."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from raylane import __version__
from raylane.config import BaseConfig
from raylane.loop import baddata, preemption
from raylane.loop.batches import Forward, StepMetrics
from raylane.loop.checkpoint.saving import Saver
from raylane.loop.data import EpochData
from raylane.loop.devices import peak_memory_bytes, reset_peak_memory, state_bytes
from raylane.loop.distributed import ControlVote, all_reduce_max, backend_name
from raylane.loop.early_stop import EarlyStopping, EvalSchedule
from raylane.loop.evaluation import EvalSets, Evaluator
from raylane.loop.faults import FaultPlan
from raylane.loop.hooks import Hooks
from raylane.loop.parallel import Strategy, no_gradient_sync
from raylane.loop.reporting import Reporter
from raylane.loop.runtime import Runtime
from raylane.loop.steps import Throughput, clip_gradients, last_step, plain_parameters, plan_steps

log = logging.getLogger("raylane")

VOTE_EVERY_N_STEPS = 10  # the first vote; then about every VOTE_INTERVAL_S
VOTE_INTERVAL_S = 0.5
VOTE_MAX_STEPS = 1000
# A failing run waits this long at most for the save in flight: a peer that died never commits it.
FAILED_RUN_SAVE_WAIT_S = 60.0
# Throughput in the result leaves out this launch's first steps (compilation, allocator and
# cache warm-up), and any before rank 0's MLflow logger has started, when the run is long
# enough to do without them.
WARMUP_STEPS = 3


def _every(count: int, n: int) -> bool:
    """Whether the `count`-th occurrence is one of every `n` (never when n is 0)."""
    return n > 0 and count % n == 0


class Trainer(EvalSchedule):
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: EpochData,
        optimizer: torch.optim.Optimizer,
        *,
        loss_fn: Callable[..., torch.Tensor] | None,
        eval_data: Iterable[Any] | dict[str, Iterable[Any]] | None,  # {name: ...}: named held-out sets
        eval_sums: Callable[..., dict[str, torch.Tensor]] | None,
        runtime: Runtime,
        reporter: Reporter,
        cfg: BaseConfig,
        faults: FaultPlan | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        control_group: Any = None,
        save_group: Any = None,
        throughput: Throughput | None = None,
        strategy: Strategy | None = None,
        hooks: Iterable[Any] = (),
        step: Callable[..., Any] | None = None,
        eval_count: Callable[[Any], Any] | None = None,
    ) -> None:
        self.model = model
        # Walking the module tree costs ~70 us a step on a small model (7% of a digits step on one
        # CPU core): the parameters are fixed once parallelized, and loads copy into them in place.
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._plain_grads = plain_parameters(self._params)
        self.train_data = train_data
        self.optimizer = optimizer
        self.forward = Forward(loss_fn, step, runtime.device)  # in the pipeline's form (raylane.loop.batches)
        self.evaluator = (
            None
            if eval_data is None
            else EvalSets(
                eval_data,
                lambda data: Evaluator(
                    data, eval_sums, runtime.device, runtime.world_size, loss_fn=loss_fn, step=step, count=eval_count
                ),
            )
        )
        self.runtime = runtime
        self.reporter = reporter
        self.cfg = cfg
        self.faults = faults
        self.scheduler = scheduler
        self.device = runtime.device
        self.throughput = throughput or Throughput()
        self.accum = cfg.train.grad_accum_steps
        self.strategy = strategy or Strategy("single" if runtime.world_size == 1 else "ddp")
        self._init_precision(cfg.train.precision)
        self.state_bytes: int | None = None
        # (wall time, process CPU time, step) once the warm-up steps are done
        self._warm: tuple[float, float, int] | None = None
        self._init_vote(control_group)
        self.saver = Saver(runtime.store, cfg.checkpoint, reporter, group=save_group, faults=faults)
        # A forward in training mode may update buffers (BatchNorm's statistics) that a save in
        # flight is still copying; parameters and optimizer state change only in the step.
        self._forward_writes_state = any(True for _ in model.buffers())
        self._saved_step: int | None = None
        # Time the loop waited on checkpoints before its last step (B7): the end-of-run save,
        # which every run pays whether saves are asynchronous or not, is left out.
        self.checkpoint_stall_s = 0.0
        self._init_progress(train_data, cfg, runtime.world_size)
        self.early_stop = EarlyStopping(cfg.train.early_stopping)
        self.hooks = Hooks(hooks, self)
        self.saver.on_committed = lambda step, where: self.hooks.call("on_checkpoint", step=step, checkpoint=where)
        self.hooks.call("setup")  # before a resume loads the hooks' state into what setup made

    def _init_vote(self, control_group: Any) -> None:
        # Step-boundary decisions all ranks must share: [stop now, async save not yet committed,
        # the launcher asked for a handover to a larger group], and values: [rank 0's step time,
        # ranks whose node is leaving (the stop is then for a restart without it, not the end)].
        self.vote = ControlVote(3, control_group)
        # Each collective outside DDP's costs a few ms on 2 busy CPU cores (one rank waits to be
        # scheduled): vote about every VOTE_INTERVAL_S, a step count agreed at each vote from
        # rank 0's step time. A stop waits at most that long; nothing is lost either way.
        self.next_vote = VOTE_EVERY_N_STEPS if self.vote.distributed else 1
        self._last_vote = (time.perf_counter(), 0)
        self.preempted = False
        self.node_leaving = False
        self._leaving_ranks, self.growing = 0, False

    def _init_precision(self, precision: str) -> None:
        # FSDP casts parameters itself (MixedPrecisionPolicy); DDP and one process use autocast.
        sharded = self.strategy.name in ("fsdp", "hsdp")
        self.autocast_dtype = (
            None if precision == "fp32" or sharded else {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        )
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None

    def _init_progress(self, train_data: EpochData, cfg: BaseConfig, world_size: int) -> None:
        # Progress, saved in every checkpoint: resume continues at exactly the next batch.
        self.epoch = 0
        self.step = 0
        self.batch_in_epoch = 0
        # Samples the whole group trained in this epoch, over every launch: the epoch's fraction
        # in samples never goes back when a resume changes the world size or the batch size.
        self.samples_seen_in_epoch = 0
        self.resumed_from_step: int | None = None
        self.steps_per_epoch, self.total_steps = plan_steps(train_data, cfg.train)
        self.batches_per_epoch = train_data.batches_in_epoch(0)  # of the epoch running; see _run_epoch
        self.samples_per_step = cfg.train.batch_size * world_size * self.accum
        self.eval_metrics: dict[str, float] = {}
        self.eval_step: int | None = None  # the step eval_metrics were measured at
        # Rank 0's throughput over the last epoch's steps, sent with its checkpoint (sweeps rank by it).
        self.speed_metrics: dict[str, float] = {}
        self._train_started = time.perf_counter()
        self._trained_before_s = 0.0  # by earlier launches of this run (from its checkpoint)
        self.skipped_steps = 0
        self.last_checkpoint: str | None = None
        # Newer checkpoints the resume passed over (damaged, unfinished): {"path", "reason"}.
        self.skipped_checkpoints: list[dict[str, str]] = []
        self.resumed_from: str | None = None  # the checkpoint loaded, by name
        self._loss_sum = torch.zeros((), device=self.device)
        self._loss_count = 0
        self._step_metrics = StepMetrics(self.device)  # a step's own, averaged over the window
        self._grad_norm: torch.Tensor | None = None
        self._window_start = time.perf_counter()
        self._window_steps = 0

    # -- the loop ------------------------------------------------------------------------------

    def run_step(self, micro_batches: list[Any]) -> torch.Tensor | None:
        """One optimizer step over `micro_batches`, exactly as training takes it (autotune times
        it); the step count, schedule and checkpoints are left to the caller."""
        return self._run_batch(micro_batches)

    def _run_batch(self, micro_batches: list[Any]) -> torch.Tensor | None:
        """One optimizer step over its micro-batches; returns the mean loss, or None when a
        non-finite update was skipped. Gradients are reduced on the last micro-batch only."""
        self.optimizer.zero_grad(set_to_none=True)
        if self._forward_writes_state:
            self._wait_for_staging()
        n = len(micro_batches)
        losses = []
        for i, batch in enumerate(micro_batches):
            last = i == n - 1
            with contextlib.nullcontext() if last else no_gradient_sync(self.model), self._autocast():
                loss, metrics = self.forward.run(self.model, batch)
                if metrics:
                    self._step_metrics.add(metrics)
                if self.faults:
                    loss = self.faults.corrupt_loss(self.step + 1, loss)
                scaled = loss / n if n > 1 else loss  # each op dispatched costs µs on tiny steps
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            losses.append(loss.detach())
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if not self._clip_gradients() and not self.scaler:  # the scaler skips such steps itself
            if self.cfg.train.on_nan == "stop":
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
        return losses[0] if n == 1 else torch.stack(losses).mean()

    def _wait_for_staging(self) -> None:
        """Before the state changes: the copy a save in flight is taking must be complete."""
        if self.saver.staging():
            blocked = time.perf_counter()
            self.saver.wait_staged()
            self.checkpoint_stall_s += time.perf_counter() - blocked

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _clip_gradients(self) -> bool:
        """The global gradient norm (over every shard under FSDP), clipped to train.grad_clip_norm;
        False when it is not finite. The gradients are already reduced, so a NaN on any rank is
        a NaN on every rank: all ranks reach the same verdict."""
        upcoming = self.step + 1  # the step being taken: its norm is logged if the window ends there
        wanted = upcoming % self.cfg.mlflow.log_every_n_steps == 0 or upcoming >= self.total_steps
        clipped = clip_gradients(
            self._params, self.cfg.train.grad_clip_norm, plain=self._plain_grads, norm_wanted=wanted
        )
        if clipped is None:
            return True
        if clipped[0] is not None:
            self._grad_norm = clipped[0].detach()
        return clipped[1]

    def _micro_batches(self):
        """The epoch's batches, grouped by optimizer step (the last group may be shorter)."""
        batches = iter(self.train_data)
        while group := list(itertools.islice(batches, self.accum)):
            yield group

    def _run_epoch(self, epoch: int) -> None:
        self.model.train()
        self.batches_per_epoch = self.train_data.batches_in_epoch(epoch)
        self.train_data.set_epoch(epoch, skip_batches=self.batch_in_epoch)
        for micro_batches in self._micro_batches():
            if self.faults:
                self.faults.before_step(self.step + 1)
            loss = self._run_batch(micro_batches)
            if self.state_bytes is None:  # optimizer state exists from the first step on
                self.state_bytes = state_bytes(self.model, self.optimizer)
            self.step += 1
            self.batch_in_epoch += len(micro_batches)
            self.samples_seen_in_epoch += len(micro_batches) * self.cfg.train.batch_size * self.runtime.world_size
            if (
                self._warm is None
                and self.step - (self.resumed_from_step or 0) >= WARMUP_STEPS
                and not self.reporter.warming()
            ):
                self._warm = (time.perf_counter(), time.process_time(), self.step)
            self._window_steps += 1
            if loss is not None:  # accumulated on the device: no host sync per step
                self._loss_sum += loss
                self._loss_count += 1
            self.reporter.on_step(epoch=epoch, step=self.step, first=self.step == (self.resumed_from_step or 0) + 1)
            logged = self._log_train_metrics() if self.step % self.cfg.mlflow.log_every_n_steps == 0 else {}
            if self.hooks:
                self._wait_for_staging()  # a skipped step did not wait, and a hook may change its saved state
                self.hooks.call("on_step_end", metrics=logged)
            epoch_end = self.batch_in_epoch >= self.batches_per_epoch  # evaluated by train(), with the epoch's
            if _every(self.step, self.cfg.train.eval_every_n_steps) and not epoch_end:
                self._evaluate_at_step(epoch_end=False)  # before the checkpoint due at this step
            every = self.cfg.checkpoint.every_n_steps
            # The last batch of an epoch, or of the run, is saved by train() after evaluation.
            last_batch = epoch_end or self.step >= self.total_steps
            if every and self.step % every == 0 and not last_batch:
                self._save_checkpoint()
            if (
                self.step >= self.total_steps
                or self.early_stop.stopped
                or (self.step >= self.next_vote and self._step_boundary())
            ):
                break

    def _step_boundary(self) -> bool:
        """Decisions every rank takes at the same step; True when the loop must stop now."""
        started, step = self._last_vote
        step_s = (time.perf_counter() - started) / max(self.step - step, 1) if self.runtime.rank == 0 else 0.0
        (stop, save_busy, growing), (agreed_step_s, leaving) = self.vote.poll(
            preemption.requested(),
            self.saver.busy(),
            preemption.growing(),
            values=(step_s, float(preemption.node_leaving())),
        )
        if self.saver.unsettled() and not save_busy:  # committed on every rank: only its outcome is left
            blocked = time.perf_counter()
            self.saver.settle()
            self.checkpoint_stall_s += time.perf_counter() - blocked
        self.next_vote = self.step + min(max(int(VOTE_INTERVAL_S / max(agreed_step_s, 1e-6)), 1), VOTE_MAX_STEPS)
        self._last_vote = (time.perf_counter(), self.step)
        self.preempted = stop
        self._leaving_ranks = round(leaving)
        restarts = stop and self.runtime.restarts_without_leaving_nodes
        # A notice to some of the ranks: restart without them. To every rank (a scheduler's
        # scancel, `timeout`): the run is being stopped, as by the driver. A notice wins over a
        # growth request in the same vote (the group that would grow is about to lose a node).
        self.node_leaving = restarts and 0 < self._leaving_ranks < self.runtime.world_size
        self.growing = restarts and growing and not self._leaving_ranks
        return stop

    def _log_train_metrics(self, until: float | None = None) -> dict[str, float]:
        """Rank 0's own training loss, as Lightning logs it by default: an all-reduce here would
        cost as much as the vote, every few steps (the held-out metrics are exact over all ranks).
        Returns what was logged ({} on other ranks)."""
        if not self.reporter.active:
            self._reset_window()
            return {}
        elapsed = (until or time.perf_counter()) - self._window_start
        samples_per_s = self._window_steps * self.samples_per_step / max(elapsed, 1e-9)
        metrics = {
            "loss": float(self._loss_sum) / max(self._loss_count, 1),
            "lr": float(self.optimizer.param_groups[0]["lr"]),
            # the window's last measured norm (a window cut short by a stop may have none)
            **({"grad_norm": float(self._grad_norm)} if self._grad_norm is not None else {}),
            "samples_per_s": samples_per_s,
            **self.throughput.rates(samples_per_s, self.runtime.world_size),
            **self._step_metrics.means(),
        }
        self.reporter.on_train_metrics(self.step, metrics)
        self._reset_window()
        return metrics

    def _reset_window(self) -> None:
        self._loss_sum.zero_()
        self._loss_count = 0
        self._step_metrics.reset()
        self._grad_norm = None
        self._window_start = time.perf_counter()
        self._window_steps = 0

    def _save_checkpoint(self) -> None:
        if self._saved_step == self.step:
            return
        blocked = time.perf_counter()
        self.saver.save(self.model, self.optimizer, self.state_dict(), hooks=self.hooks.state_dict())
        self._saved_step = self.step
        if self.step < self.total_steps:
            self.checkpoint_stall_s += time.perf_counter() - blocked

    def train(self) -> dict[str, Any]:
        self.reporter.on_start(
            total_steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch,
            max_epochs=self.cfg.train.epoch_limit,
            world_size=self.runtime.world_size,
            resumed_from_step=self.resumed_from_step,
            resumed_from=self.resumed_from,
            skipped_checkpoints=self.skipped_checkpoints,
            strategy=self.strategy.name,
            strategy_reason=self.strategy.reason,
            strategy_tags=self.strategy.tags(),
        )
        reset_peak_memory(self.device)
        started, started_cpu, first_step = time.perf_counter(), time.process_time(), self.step
        self.next_vote = self.step + (VOTE_EVERY_N_STEPS if self.vote.distributed else 1)
        self._last_vote = (started, self.step)
        epoch_ends: list[float] = []  # seconds from the start to the end of each epoch's end work
        self._train_started = started
        with preemption.armed(), self.saver.settled_on_failure(min(self.cfg.dist.timeout_s, FAILED_RUN_SAVE_WAIT_S)):
            last_step_end = started
            while self.step < self.total_steps and not self.preempted and not self.early_stop.stopped:
                epoch_start = (time.perf_counter(), self.step)
                self._run_epoch(self.epoch)
                last_step_end = self.step_clock()
                epoch_ended = self.batch_in_epoch >= self.batches_per_epoch  # not a max_steps stop or a stop
                if epoch_ended:
                    self.speed_metrics = self._epoch_speed(epoch_start, last_step_end)
                    if _every(self.epoch + 1, self.cfg.train.eval_every_n_epochs) or _every(
                        self.step, self.cfg.train.eval_every_n_steps
                    ):
                        self._evaluate_at_step()
                    self.epoch += 1
                    self.batch_in_epoch = self.samples_seen_in_epoch = 0
                # A stop (an early one too) always saves, mid-epoch or at an epoch end that no
                # checkpoint was due at.
                due = (
                    self.preempted
                    or self.early_stop.stopped
                    or not epoch_ended
                    or _every(self.epoch, self.cfg.checkpoint.every_n_epochs)
                )
                if due or self.step >= self.total_steps:
                    self._save_checkpoint()
                if epoch_ended:
                    epoch_ends.append(round(time.perf_counter() - started, 4))
            self.saver.settle()  # a save in flight is committed before the run ends or stops
            self.saver.close()
            self.vote.close()
        if self._loss_count:
            self._log_train_metrics(until=last_step_end)  # not the end-of-run save and evaluation
        # A max_steps stop mid-epoch, an epoch left unevaluated, or resumed at the end.
        if self.eval_step != self.step and not self.preempted:
            self._record_eval(self._evaluate(), decide=False)
        return self.reporter.on_end(
            {**self._result((started, started_cpu, first_step), last_step_end), "epoch_end_s": epoch_ends}
        )

    def _result(self, start: tuple[float, float, int], last_step_end: float) -> dict[str, Any]:
        """The run's figures, from `start` (wall time, CPU time, step) or, when the run was long
        enough, from the end of the warm-up steps."""
        ended, ended_cpu = time.perf_counter(), time.process_time()
        if self._warm is not None and self.step - self._warm[2] >= WARMUP_STEPS:
            start = self._warm
        started, started_cpu, first_step = start
        # To the end of the last step: the end-of-run checkpoint and evaluation are not training
        # throughput (a GPT-2 save on one H100 took as long as 50 steps).
        samples_per_s = (self.step - first_step) * self.samples_per_step / max(last_step_end - started, 1e-9)
        return {
            "step_time_s": (last_step_end - started) / max(self.step - first_step, 1),
            "epochs": self.epoch,
            "partial_epoch": self._partial_epoch(),  # a stop mid-epoch
            "steps": self.step,
            "metrics": self.eval_metrics,
            "samples_per_s": samples_per_s,
            **self.throughput.rates(samples_per_s, self.runtime.world_size),
            "memory": self._memory(),
            "strategy": self.strategy.name,
            "mesh": list(self.strategy.mesh_shape),
            "node_ranks": self.runtime.node_ranks,
            "train_s": ended - started,
            # Every launch's training time, warm-up steps included (time to a target).
            "train_wall_s": self._trained_before_s + ended - self._train_started,
            # This process's CPU time over the same span, every thread counted (gloo's, Ray's):
            # much less sensitive than train_s to other processes on a busy machine (B1).
            "train_cpu_s": ended_cpu - started_cpu,
            "checkpoint_stall_s": self.checkpoint_stall_s,
            "resumed_from_step": self.resumed_from_step,
            "checkpoint": self.saver.last_checkpoint or self.last_checkpoint,
            "world_size": self.runtime.world_size,
            "backend": backend_name(),
            "skipped_steps": self.skipped_steps,
            "skipped_rows": baddata.skipped_rows(),  # what this process counted (the summary's)
            "failed_checkpoints": self.saver.failed,
            "preempted": self.preempted,
            "node_leaving": self.node_leaving,
            "growing": self.growing,
            "stop_reason": self._stop_reason(),
            "early_stopped": self.early_stop.stopped and not self.preempted,
        }

    def _partial_epoch(self) -> float:
        """The share of the running epoch trained, in samples over every launch of the run (the
        epoch's samples as this launch splits them); a resume that restarted the epoch (another
        world size) counts what it trained before too, so it is capped at 1."""
        epoch_samples = self.batches_per_epoch * self.cfg.train.batch_size * self.runtime.world_size
        return round(min(self.samples_seen_in_epoch / max(epoch_samples, 1), 1.0), 4)

    def _stop_reason(self) -> str | None:
        if not self.preempted:
            return self.early_stop.reason
        if self.growing:
            return preemption.GROWING
        if self.node_leaving:
            return f"notice to {self._leaving_ranks} of {self.runtime.world_size} ranks that their node is leaving"
        return preemption.reason() or "a stop request from another rank"

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

    def step_clock(self) -> float:
        """Now, once the device has finished the steps queued so far."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _memory(self) -> dict[str, int]:
        """Collective. The largest figures over the ranks."""
        if self.state_bytes is None:
            self.state_bytes = state_bytes(self.model, self.optimizer)
        worst = all_reduce_max(
            {"state_bytes_per_rank": self.state_bytes, "peak_bytes": peak_memory_bytes(self.device)}, self.device
        )
        return {k: int(v) for k, v in worst.items()}

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "batch_in_epoch": self.batch_in_epoch,
            # The position in samples of the whole group: what a resume on another world size
            # continues from when the global batch is held (train.global_batch).
            "samples_in_epoch": self.batch_in_epoch * self.cfg.train.batch_size * self.runtime.world_size,
            "samples_seen_in_epoch": self.samples_seen_in_epoch,
            "samples_per_step": self.samples_per_step,
            # Training seconds over every launch of the run (a time-to-target sweep ranks by it).
            "train_s_total": self._trained_before_s + time.perf_counter() - self._train_started,
            "global_order": self.cfg.train.global_batch is not None,
            "world_size": self.runtime.world_size,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            # Metrics measured at this very step (an epoch end), for checkpoint.keep_best.
            "eval_metrics": self.eval_metrics if self.eval_step == self.step else None,
            "early_stopping": self.early_stop.state_dict(),
            "speed_metrics": self.speed_metrics if self.eval_step == self.step else None,
            "config": self.cfg.model_dump(mode="json"),
            "raylane_version": __version__,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.step = int(state["step"])
        # Batches per epoch depend on the world size: a resharded resume restarts the epoch,
        # unless the epoch's order is global and the global batch held (train.global_batch):
        # then it continues at the same sample.
        same_world = state.get("world_size") == self.runtime.world_size
        global_order = (
            state.get("global_order")
            and self.cfg.train.global_batch is not None
            and state.get("samples_per_step") == self.samples_per_step
        )
        samples = state.get("samples_in_epoch")  # the group's position in the epoch
        if (global_order or same_world) and samples is not None:
            # In samples: the micro-batch may have changed (at any world size with a global
            # order; on the same world each rank's order is the same whatever the batch).
            self.batch_in_epoch = int(samples) // (self.cfg.train.batch_size * self.runtime.world_size)
        elif same_world:
            self.batch_in_epoch = int(state["batch_in_epoch"])
        else:
            self.batch_in_epoch = 0
        # A checkpoint from before samples_seen_in_epoch: its position is what it had trained.
        seen = state.get("samples_seen_in_epoch", samples)
        self.samples_seen_in_epoch = int(seen) if seen is not None else 0
        self._trained_before_s = float(state.get("train_s_total") or 0.0)
        self.total_steps = last_step(
            self.train_data, self.cfg.train, epoch=self.epoch, batch_in_epoch=self.batch_in_epoch, step=self.step
        )
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])
        for factor in getattr(self.scheduler, "lr_lambdas", ()):  # raylane.loop.run's schedules end there too
            if isinstance(getattr(factor, "horizon", None), dict):
                factor.horizon["total_steps"] = self.total_steps
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        if state.get("eval_metrics"):
            self.eval_metrics, self.eval_step = dict(state["eval_metrics"]), self.step
        self.early_stop.load_state_dict(state.get("early_stopping"))
        self.hooks.load_state_dict(state.get("hook_states") or {})
        self.resumed_from_step = self.step
