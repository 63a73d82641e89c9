"""What a sweep's trial reports beside its eval metrics and its throughput (RunResult.speed, under
the names `sweep.metric` may rank by): under a time-to-target objective, the training seconds
until the target was reached (`Objective`). Nothing here imports torch or Ray: the trial that
reports them runs under Tune (raylane.onray.tune)."""

from __future__ import annotations

from raylane.config.sweep import TIME_TO_TARGET, SweepSection

# What a trial that has not reached the target reports: worse than any real time, and finite,
# which ASHA's quantiles and MLflow need.
NOT_REACHED_S = 1e9


class Objective:
    """A trial's reports with `time_to_target_s` added under a time-to-target objective: the
    training time of the first report that reached the value, NOT_REACHED_S until one does."""

    def __init__(self, sweep: SweepSection) -> None:
        self.target = sweep.objective.time_to if sweep.objective else None
        self.reached_s: float | None = None

    def __call__(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.target is None:
            return metrics
        value = metrics.get(self.target.metric)
        hit = value is not None and (
            value >= self.target.value if self.target.mode == "max" else value <= self.target.value
        )
        if hit and self.reached_s is None:
            self.reached_s = float(metrics.get("train_s", NOT_REACHED_S))
        return {**metrics, TIME_TO_TARGET: self.reached_s if self.reached_s is not None else NOT_REACHED_S}
