"""How a run's worker group changes size and survives losses on Ray Train: the scaling policies
(held global batch, handover before growing, no autoscaler requests on an embedded cluster), the
failure policy that does not count a node's notice as a failure, and how many restarts a run
gets. The ranks' side of a handover is in raylane.loop.preemption and the Trainer's vote."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.train import FailureConfig, ScalingConfig

from raylane.config import BaseConfig
from raylane.errors import RaylaneError
from raylane.onray.internals import DefaultFailurePolicy, ElasticScalingPolicy, FixedScalingPolicy

# How long the elastic policy waits for a group to hand over before resizing it anyway: a vote,
# the step it waits for and a checkpoint's commit (a large model's takes a minute or more).
HANDOVER_WAIT_S = 300.0
# Handovers (a node's notice, a growth that did not come) restart the group without counting
# against failure.max_failures, up to this many in a run.
MAX_HANDOVERS = 1000


class NodeLeaving(RaylaneError, RuntimeError):
    """Raised on every rank once the checkpoint agreed after a node's notice is committed: Ray
    Train restarts the group (on the nodes that remain, for an elastic run) from that checkpoint.
    A clean return would end the run."""


class HeldBatchElasticPolicy(ElasticScalingPolicy):
    """Ray Train's elastic policy, kept to the sizes that split the run's global batch: Ray
    counts the workers that fit (by whole nodes on a GPU cluster, or any number), and the group
    starts on the largest of `sizes` at or below that count. Without it, 3 workers fitting a
    [2, 4] run with a global batch of 8 would start a group that cannot hold it."""

    def __init__(self, scaling_config: ScalingConfig, sizes: list[int], sink: Any = None) -> None:
        super().__init__(scaling_config)
        self.sizes = sorted(sizes)
        self._sink = sink
        self._pending: tuple[Any, float] | None = None  # (a resize up, when the handover was asked)

    def _count_possible_workers(self, reserved_resources) -> int:
        fit = super()._count_possible_workers(reserved_resources)
        return max((n for n in self.sizes if n <= fit), default=fit)  # below min: Ray waits

    def make_decision_for_non_running_worker_group(self):
        self._drop_pending()
        return super().make_decision_for_non_running_worker_group()

    def _drop_pending(self) -> None:
        if self._pending is not None and self._sink is not None:
            self._sink.clear_handover.remote()
        self._pending = None

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        """A resize up waits for the group to hand over: checkpoint at an agreed step and wait
        (raylane.loop.preemption.GROWING), so that growing redoes no step. Ray's own resize would
        stop the group where it is, losing the steps since the last periodic checkpoint."""
        from raylane.onray.internals import NoopDecision

        if self._pending is not None:
            decision, asked = self._pending
            if not (self._handed_over() or time.monotonic() - asked > HANDOVER_WAIT_S):
                return NoopDecision()
            self._drop_pending()
            # Counted again now: the resources may have changed while the group handed over.
            # The group waits for a restart either way, at the old size if nothing more fits.
            reserved = self._get_reserved_resources()
            fit = self._count_possible_workers(reserved) if reserved is not None else decision.num_workers
            return self._get_resize_decision(max(fit, self.scaling_config.min_workers))
        decision = super().make_decision_for_running_worker_group(worker_group_state, worker_group_status)
        grows = getattr(decision, "num_workers", 0) > worker_group_state.num_workers
        if grows and self._sink is not None:
            self._sink.request_handover.remote()
            self._pending = (decision, time.monotonic())
            return NoopDecision()
        return decision

    def _handed_over(self) -> bool:
        try:
            return bool(ray.get(self._sink.handed_over.remote(), timeout=5))
        except Exception:  # noqa: BLE001 - no answer: ask again at the next poll
            return False


class HandoverFailurePolicy(DefaultFailurePolicy):
    """Ray Train's failure policy, except that a group that raised NodeLeaving on every rank it
    heard from (it checkpointed for a node's notice) is restarted without counting against
    failure.max_failures: a long run on spot nodes gets many notices; and one whose ranks refused
    their config (raylane.onray.failures.bad_input) is not restarted: it would refuse it again."""

    def __init__(self, failure_config: FailureConfig) -> None:
        super().__init__(failure_config)
        self._handovers = 0

    def make_decision(self, training_failed_error):
        from raylane.onray.failures import bad_input
        from raylane.onray.internals import FailureDecision

        if bad_input(training_failed_error) is not None:
            return FailureDecision.RAISE
        failures = getattr(training_failed_error, "worker_failures", None) or {}
        if failures and all("NodeLeaving" in f"{type(e).__name__} {e}" for e in failures.values()):
            self._handovers += 1
            if self._handovers <= MAX_HANDOVERS:
                return FailureDecision.RETRY
        return super().make_decision(training_failed_error)


class NoAutoscalerScalingPolicy(FixedScalingPolicy):
    """Ray Train's fixed-size policy, less its resource requests to the autoscaling coordinator.
    The first request starts the coordinator actor (another process) and blocks the controller
    for up to 5 s until it answers, before any worker starts; an embedded cluster has no
    autoscaler to pass the request to."""

    def after_controller_start(self, train_run_context) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass

    def _cancel_resource_request(self) -> None:
        pass


# An elastic run restarts on the survivors when a worker or node is lost: it may do so this many
# times when failure.max_failures is left at 0 (a fixed-size run fails at the first loss).
ELASTIC_MAX_FAILURES = 10


def max_failures(cfg: BaseConfig) -> int:
    return cfg.failure.max_failures or (ELASTIC_MAX_FAILURES if cfg.scaling.elastic else 0)


def failure_config(cfg: BaseConfig) -> FailureConfig:
    """Ray Train's FailureConfig for a run. Ray 2.60 retries a preemption on a budget of its own
    (max_preemption_failures, unlimited by default), even at max_failures 0. A run that may not
    restart gets none: a notice its ranks could not honour within the drain window (a save longer
    than the window) ends the run instead of restarting it from an older checkpoint unasked."""
    retries = max_failures(cfg)
    if retries == 0 and "max_preemption_failures" in FailureConfig.__dataclass_fields__:
        return FailureConfig(max_failures=0, max_preemption_failures=0)
    return FailureConfig(max_failures=retries)


def ray_num_workers(cfg: BaseConfig) -> int | tuple[int, int]:
    """Ray Train's num_workers: (min, max) selects its elastic scaling policy."""
    s = cfg.scaling
    return (s.min_workers, s.num_workers) if s.elastic else s.num_workers
