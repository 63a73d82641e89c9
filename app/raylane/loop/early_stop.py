"""The Trainer's evaluations (`EvalSchedule`): at epoch ends and every `train.eval_every_n_steps`,
their metrics reported, handed to the hooks and to early stopping (`train.early_stopping`: the
run ends once a held-out metric has not improved for `patience` evaluations). The metrics are
all-reduced, so every rank takes the same decision at the same step; the early-stopping state is
saved in every checkpoint, so that a resume goes on counting."""

from __future__ import annotations

import logging
import math
from typing import Any

from raylane.errors import RaylaneError

log = logging.getLogger("raylane")


class EarlyStoppingMetricError(RaylaneError, ValueError):
    """The metric early stopping watches is not among those the evaluation reports."""


class EarlyStopping:
    def __init__(self, cfg: Any) -> None:
        """`cfg`: a raylane.config.EarlyStoppingSection, or None (never stops)."""
        self.cfg = cfg
        self.best: float | None = None
        self.best_step: int | None = None
        self.since_best = 0  # evaluations without improvement since the best
        self.reason: str | None = None  # set once the run is to stop

    @property
    def stopped(self) -> bool:
        return self.reason is not None

    def update(self, metrics: dict[str, float], step: int) -> bool:
        """After an evaluation at `step`: True when the run must stop now."""
        c = self.cfg
        if c is None or self.stopped:
            return self.stopped
        if c.metric not in metrics:  # the same metrics on every rank (all-reduced): every rank raises
            reported = ", ".join(sorted(metrics)) or "none: the pipeline gives no eval_set"
            raise EarlyStoppingMetricError(
                f"train.early_stopping.metric = {c.metric!r}: not a held-out metric of "
                f"this run; the evaluation at step {step} reported {reported}"
            )
        value = float(metrics[c.metric])
        better = math.isfinite(value) and (
            self.best is None
            or (value < self.best - c.min_delta if c.mode == "min" else value > self.best + c.min_delta)
        )
        if better:
            self.best, self.best_step, self.since_best = value, step, 0
            return False
        self.since_best += 1
        if self.since_best >= c.patience:
            what = "decrease" if c.mode == "min" else "increase"
            by = f" by more than {c.min_delta:g}" if c.min_delta else ""
            best = f"best {self.best:.4g} at step {self.best_step}" if self.best is not None else "no finite value"
            self.reason = (
                f"early stopping: {c.metric} did not {what}{by} for {self.since_best} evaluation"
                f"{'s' if self.since_best > 1 else ''} ({best})"
            )
        return self.stopped

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "since_best": self.since_best,
            "reason": self.reason,
            "metric": getattr(self.cfg, "metric", None),
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.reason = state.get("reason")  # an early-stopped run stays stopped
        if self.cfg is not None and state.get("metric") == self.cfg.metric:  # a count of another metric does not carry
            self.best, self.best_step = state.get("best"), state.get("best_step")
            self.since_best = int(state.get("since_best") or 0)


class EvalSchedule:
    """Evaluation, as a part of raylane.loop.trainer.Trainer (whose attributes it uses)."""

    def _record_eval(self, metrics: dict[str, float], *, epoch_end: bool = True, decide: bool = True) -> None:
        """`decide`: an evaluation of the loop, which early stopping counts (not the run's last)."""
        self.eval_step = self.step
        self.reporter.on_eval(epoch=self.epoch, step=self.step, metrics=metrics, epoch_end=epoch_end)
        if decide:
            self.early_stop.update(metrics, self.step)  # all-reduced metrics: every rank decides alike
        self.hooks.call("on_eval_end", metrics=metrics)

    def _evaluate(self) -> dict[str, float]:
        self.eval_metrics = self.evaluate_now()
        return self.eval_metrics

    def evaluate_now(self) -> dict[str, float]:
        """Collective. The model as it is, on the held-out sets ({} without one); back in train mode after."""
        if self.evaluator is None:
            return {}
        try:
            return self.evaluator(self.model)
        finally:
            self.model.train()
            if callable(reshard := getattr(self.model, "reshard", None)):  # FSDP's root keeps its gathered
                reshard()  # parameters after a forward: sharded again, as hooks and saves expect

    def _evaluate_at_step(self, *, epoch_end: bool = True) -> None:
        """An evaluation measured before the checkpoint of its step (an epoch end's, or one of
        train.eval_every_n_steps), which carries the metrics checkpoint.keep_best ranks by.
        Should it fail (the user's eval_sums, a bad held-out row: on any rank, all learn of
        it), the step is saved before the error ends the run, so that no step trained since the
        last checkpoint is lost."""
        try:
            metrics = self._evaluate()
        except Exception:
            if epoch_end:
                self.epoch, self.batch_in_epoch, self.samples_seen_in_epoch = self.epoch + 1, 0, 0
            try:
                self._save_checkpoint()  # without metrics: none were measured
                self.saver.settle()
            except Exception as exc:  # noqa: BLE001 - the evaluation's error is the run's
                log.warning("the checkpoint at step %d, after the evaluation failed, was not saved: %s", self.step, exc)
            raise
        self._record_eval(metrics, epoch_end=epoch_end)
