"""What the sweep's driver watches while Tune runs the trials: each trial's MLflow run closed when
Tune ends it (`TrialRuns`), and a sweep metric no trial reports (`MetricReported`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from ray import tune
from ray.tune.result import AUTO_RESULT_KEYS

from raylane.config import ConfigError
from raylane.config.sweep import SweepSection
from raylane.results import Status
from raylane.sweeps.results import find_child
from raylane.tracking.runs import RunHandle, close_run, mlflow_client

log = logging.getLogger("raylane")


class MetricReported(tune.Stopper):
    """A pipeline of the user's own may declare no metrics, so a misspelled `sweep.metric` is seen
    only at the first report: end the sweep there, not after every trial ran with no best one."""

    OURS = frozenset(
        {
            "epoch",
            "step",
            "checkpoint_location",
            "run_id",
            "exploited",
            "done",
            "trial_id",
            "experiment_tag",
            "should_checkpoint",
        }
    )

    def __init__(self, metric: str) -> None:
        self.metric, self.reported = metric, None

    def __call__(self, trial_id: str, result: dict[str, Any]) -> bool:
        if self.metric not in result and self.reported is None:
            skip = self.OURS | set(AUTO_RESULT_KEYS)
            self.reported = sorted(k for k, v in result.items() if k not in skip and isinstance(v, (int, float)))
        return self.reported is not None

    def stop_all(self) -> bool:
        return self.reported is not None

    def check(self) -> None:
        if self.reported is not None:
            raise ConfigError(
                f"sweep.metric = {self.metric!r}: the trials report no such metric "
                f"(they report: {', '.join(self.reported) or 'none'})"
            )


class TrialRuns(tune.Callback):
    """On the driver: close each trial's MLflow run when Tune ends the trial (early-stopped
    trials are killed with their actor, so they cannot close it themselves)."""

    def __init__(self, parent: RunHandle, sweep: SweepSection, max_epochs: int) -> None:
        self.parent, self.sweep, self.max_epochs = parent, sweep, max_epochs

    def _close(self, trial, failed: bool) -> None:
        result = trial.last_result or {}
        shown = f"{self.sweep.metric} {result[self.sweep.metric]:.4f}, " if self.sweep.metric in result else ""
        print(
            f"[raylane] trial {trial.trial_id} ended: {'FAILED' if failed else 'done'} "
            f"({shown}epoch {result.get('epoch', 0)} of {self.max_epochs})",
            flush=True,
        )
        try:
            client = mlflow_client(self.parent.tracking_uri)
            run = find_child(client, self.parent.experiment_id, self.sweep.name, trial.trial_id)
            if run is None:
                return
            epochs = (trial.last_result or {}).get("epoch", 0)
            if stopped_early(run.info.status, failed, epochs, self.max_epochs):
                # Here, not in the trial: Tune may SIGTERM a stopped trial's actor (when no
                # trial is left to reuse it) before the trial's own handler has written anything.
                keep_stopped_trials_eval(client, run.info.run_id, result.get("step"), eval_metrics(result))
                client.set_tag(run.info.run_id, "raylane.early_stopped", "true")
                client.set_tag(run.info.run_id, "raylane.stopped_at_epoch", str(epochs))
            if run.info.status == "RUNNING":
                close_run(
                    RunHandle(run.info.run_id, self.parent.experiment_id, self.parent.tracking_uri, False),
                    Status.FAILED if failed else (Status.KILLED if epochs < self.max_epochs else Status.FINISHED),
                )
        except Exception as exc:  # noqa: BLE001 - records must not stop the sweep
            log.warning("MLflow: could not close trial %s: %s", trial.trial_id, exc)

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._close(trial, failed=False)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._close(trial, failed=True)


def stopped_early(status: str, failed: bool, epochs: int, max_epochs: int) -> bool:
    """Whether Tune ended a trial before its run did (a scheduler's or stopper's stop), from its
    MLflow run's status when Tune ends it. A trial whose Train run returned closed that run
    FINISHED itself: it ran its course, at max_epochs or at train.max_steps before it."""
    return not failed and status != Status.FINISHED and epochs < max_epochs


def eval_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The pipeline's metrics in a trial's Tune result: neither raylane's keys nor Tune's."""
    skip = MetricReported.OURS | set(AUTO_RESULT_KEYS)
    return {
        k: v for k, v in result.items() if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def keep_stopped_trials_eval(client, run_id: str, step: int | None, metrics: dict[str, Any]) -> None:
    """A trial the scheduler stops is torn down with its workers, and rank 0's last buffered
    metrics go with them: the epoch end Tune judged it on is written from the sweep's driver,
    where MLflow does not have it yet, so that the run shows what it was stopped for."""
    from mlflow.entities import Metric

    if step is None:
        return
    try:
        now_ms = int(time.time() * 1000)
        missing = [
            Metric(f"eval/{k}", float(v), now_ms, step)
            for k, v in metrics.items()
            if isinstance(v, (int, float))
            and not any(m.step == step for m in client.get_metric_history(run_id, f"eval/{k}"))
        ]
        if missing:
            client.log_batch(run_id, metrics=missing)
    except Exception as exc:  # noqa: BLE001 - the sweep goes on; the trial's run is closed by its caller
        log.warning("trial run %s: its last evaluation could not be recorded: %s", run_id, exc)
