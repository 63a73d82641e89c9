"""Rank-0-only side effects, in one place: progress for the driver and metrics for MLflow.

Every method is a no-op on other ranks, so the Trainer calls them unconditionally. Nothing here
may block a training step: progress is rate-limited and MLflow logging runs on its own thread."""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable
from typing import Any

from raylane.loop.protocols.events import (
    Checkpoint,
    CheckpointFailed,
    End,
    Eval,
    Event,
    FirstStep,
    Handover,
    Log,
    Progress,
    ReplicaHealed,
    ReplicaQuorum,
    Start,
    Straggler,
)
from raylane.loop.protocols.result import RunResult

PROGRESS_INTERVAL_S = 0.5
# The training figures of one window of steps, as MLflow records them at the window's last step.
WINDOW_KEYS = ("loss", "samples_per_s", "tokens_per_s", "real_tokens_per_s", "padding_share")
# Stragglers named one by one (an event and the tag `raylane.straggler.rank<R>` each); past them
# (a slow rack at 1,024 ranks), one line says so and the run's end counts the others in the tag
# `raylane.stragglers_more`: the run's summary lists every one.
MAX_STRAGGLERS_NAMED = 8


class Reporter:
    """What rank 0's Trainer tells the driver (events, through `publish`) and MLflow (through
    `metric_logger`, on its own thread); every method is a no-op on the other ranks."""

    def __init__(
        self, *, is_rank_zero: bool, publish: Callable[[Event], None], metric_logger: Any | None = None
    ) -> None:
        self.active = is_rank_zero
        # With replica groups, the run's figures (progress, metrics, evaluations, checkpoints) come
        # from the group that leads (the lowest alive: raylane.loop.distributed.ft), so MLflow and
        # the terminal get one series; each group's rank 0 still says its own start and end.
        self.leads = True
        self.replicas: Any = None  # their figures: each window's (`window()`) and the run's (`summary()`)
        self._publish = publish
        self._metrics = metric_logger if is_rank_zero else None
        self._last_publish = float("-inf")
        self._state: dict[str, Any] = {}
        self._window_from = 1  # the first step of the window the next train metrics cover
        self._stragglers = 0

    def warming(self) -> bool:
        """Rank 0's MLflow logger is still starting (importing MLflow, ~1.5 s of CPU on a thread):
        on a busy machine, steps taken meanwhile are slower than training's, and a throughput
        that counted them would read low (a 750-step run on 2 cores: 0.56 of its steady rate)."""
        return self._metrics is not None and not self._metrics.ready.is_set()

    def on_start(self, **info: Any) -> None:
        if self.active:
            self._state.update(info)
            self._window_from = (info.get("resumed_from_step") or 0) + 1
            self._publish(Start(host=socket.gethostname(), **info))

    def on_step(self, *, epoch: int, step: int, first: bool) -> None:
        if not self.active:
            return
        now = time.monotonic()
        if first:
            self._publish(FirstStep(step=step, time_unix=time.time()))
        if self.leads and now - self._last_publish >= PROGRESS_INTERVAL_S:
            self._last_publish = now
            state = dict(self._state)
            self._publish(Progress(epoch=epoch, step=step, window=state.pop("window", None), state=state))

    def on_train_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """`metrics` cover the steps since the previous call (a window), and go to MLflow at `step`."""
        if not self.active:
            return
        self._state.update(metrics)
        self._state["window"] = {
            "first_step": self._window_from,
            "last_step": step,
            **{k: metrics[k] for k in WINDOW_KEYS if k in metrics},
        }
        self._window_from = step + 1
        if self.replicas is not None:  # the fewest groups that stepped together in the window
            metrics = {**metrics, **self.replicas.window()}
        if self._metrics is not None and self.leads:
            self._metrics.log({f"train/{k}": v for k, v in metrics.items()}, step)

    def on_eval(self, *, epoch: int, step: int, metrics: dict[str, float], epoch_end: bool = True) -> None:
        """`epoch_end`: False for an evaluation part-way through an epoch (train.eval_every_n_steps)."""
        if not (self.active and self.leads):
            return
        if self._metrics is not None:
            self._metrics.log({f"eval/{k}": v for k, v in metrics.items()}, step)
        self._publish(Eval(epoch=epoch, step=step, metrics=metrics, epoch_end=epoch_end))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """A hook's own metrics, to MLflow under the names given (raylane.loop.protocols.hooks)."""
        if self._metrics is not None and self.leads:
            self._metrics.log(metrics, step)

    def on_replicas(self, event: ReplicaHealed | ReplicaQuorum) -> None:
        """A replica group healed, or the groups taking part changed (raylane.loop.distributed.ft)."""
        if self.active:
            self._publish(event)

    def on_straggler(self, record: dict[str, Any], line: str) -> None:
        """A rank named as slow (raylane.loop.observe.steptimes): the driver says it once, on the terminal."""
        if not self.active:
            return
        self._stragglers += 1
        if self._stragglers <= MAX_STRAGGLERS_NAMED:
            self._publish(Straggler(record=record, line=line))
            if self._metrics is not None:
                # First set, kept: a restarted group names its stragglers anew (this count starts again).
                self._metrics.set_first_tags({f"raylane.straggler.rank{record['rank']}": line})
            return
        if self._stragglers == MAX_STRAGGLERS_NAMED + 1:  # the driver says it once; the summary lists them all
            self._publish(Log(rank=0, level="warning", message=f"more than {MAX_STRAGGLERS_NAMED} stragglers: the "
                              "run's summary lists them all"))  # fmt: skip

    def on_checkpoint(
        self, *, step: int, location: str, epoch: int, metrics: dict[str, float], speed: dict[str, float] | None = None
    ) -> None:
        """`metrics` are the eval metrics measured at this step (an epoch end), else empty; `speed`
        rank 0's throughput over that epoch (Trainer._epoch_speed)."""
        if self.active:
            self._publish(
                Checkpoint(
                    step=step, location=location, epoch=epoch, metrics=metrics, speed=speed or {}, time_unix=time.time()
                )
            )

    def on_checkpoint_failed(self, *, step: int, error: str) -> None:
        if self.active:
            self._publish(CheckpointFailed(step=step, error=error))

    def on_end(self, result: RunResult) -> RunResult:
        """Publish the result; returns it with what rank 0 alone knows added: the last window's
        figures and the steps per epoch announced at the start, and MLflow logging's cost."""
        if not self.active:
            return result
        # The last window's figures: the progress display's last line, the summary and MLflow's
        # last train/* values are all these.
        result = dataclasses.replace(
            result, last_window=self._state.get("window"), steps_per_epoch=self._state.get("steps_per_epoch")
        )
        if self.replicas is not None:
            result = dataclasses.replace(result, replicas=self.replicas.summary())
        if self._metrics is not None:
            if self._stragglers > MAX_STRAGGLERS_NAMED:
                self._metrics.set_first_tags({"raylane.stragglers_more": str(self._stragglers - MAX_STRAGGLERS_NAMED)})
            self._metrics.close()
            result = dataclasses.replace(result, tracking_cost_s=self._metrics.cost())
        # A group that hands over to a restart without a leaving node has not ended the run.
        kind = Handover if result.node_leaving or result.growing else End
        self._publish(kind(time_unix=time.time(), result=result))
        return result
