"""Early stopping (`train.early_stopping`): the run ends once a held-out metric has not improved
for `patience` evaluations. It counts the evaluations of raylane.loop.evaluation.Evaluation,
whose metrics are all-reduced, so every rank takes the same decision at the same step; its state
is saved in every checkpoint, so that a resume goes on counting."""

from __future__ import annotations

import math
from typing import Any

from raylane.config import EarlyStoppingSection
from raylane.errors import RaylaneError


class EarlyStoppingMetricError(RaylaneError, ValueError):
    """The metric early stopping watches is not among those the evaluation reports."""


class EarlyStopping:
    """The count of evaluations without improvement, and the reason to stop once it reaches the
    patience."""

    def __init__(self, cfg: EarlyStoppingSection | None) -> None:
        """`cfg`: None never stops."""
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
