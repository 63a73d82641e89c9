"""What the sweep's driver watches while Tune runs the trials: each trial Tune stops while it runs
stopped at its ranks' next step boundary, and its MLflow run closed once they have (`TrialRuns`);
every running trial stopped the same way, and every run of the sweep closed, when the driver is
sent SIGTERM or Ctrl-C (`TrialRuns.interrupted`); a sweep metric no trial reports
(`MetricReported`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import tune
from ray.tune.result import AUTO_RESULT_KEYS

from raylane.config import ConfigError
from raylane.config.sweep import SweepSection
from raylane.onray.cluster import RayStopper
from raylane.results import Status, SweepSummary
from raylane.session import INTERRUPTED, RunSession, raise_interrupt
from raylane.sweeps.results import find_child
from raylane.sweeps.runs import has_trained, open_children
from raylane.tracking.runs import ERROR_TAG, RunHandle, close_run, mlflow_client

log = logging.getLogger("raylane")

RANKS_STOP_S = 60.0  # a stopped trial's ranks: the next vote, a checkpoint, rank 0's last metrics
RANKS_POLL_S = 0.5
STOP_DELAY_ENV = "RAYLANE_TEST_TUNE_STOP_DELAY_S"
# SIGTERM or Ctrl-C to the sweep's driver. A scheduler's grace before its SIGKILL is often 30 s
# (Kubernetes' default, Slurm's KillWait): the running trials' ranks get 20 s to reach their next
# step-boundary vote, checkpoint and end, their trials to close their runs; then Ray stops and the
# driver closes what is still open.
INTERRUPT_STOP_S = 20.0
ENDED_GRACE_S = 3.0  # a trial whose ranks have ended (or never started) closes its run within this
SECOND_SIGNAL_S = 2.0  # a second signal sooner is the same stop (a terminal's Ctrl-C beside a wrapper's SIGTERM)
STOPPING_SET_S = 5.0  # the driver marks the sweep stopping (an actor on its own node)
STOPPING_ASK_S = 5.0  # a failed trial asks whether the sweep is stopping
CLOSING_JOIN_S = 10.0  # Tune's stops' closing threads, once Ray is gone (their wait ends with it)


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


@dataclass
class Interrupted:
    """What a sweep's SIGTERM or Ctrl-C ended: how many trials' runs (running at the signal, or
    opened by a trial still starting before Ray stopped), and how many of those trials' ranks
    stopped at a step boundary with a checkpoint."""

    trials: int
    checkpointed: int

    def line(self, sweep: str) -> str:
        """The one line the terminal shows (the summary's error, the parent run's raylane.error)."""
        if self.trials == 0:
            closed = "no trial was running; its MLflow parent run closed KILLED"
        else:
            trials = f"{self.trials} running trial{'' if self.trials == 1 else 's'}"
            saved = f", {self.checkpointed} checkpointed where {'it' if self.checkpointed == 1 else 'they'} stopped"
            closed = (
                f"the MLflow runs of its {trials} and its parent run closed KILLED{saved if self.checkpointed else ''}"
            )
        return f"interrupted: sweep {sweep} stopped; {closed}; rerun the same command to continue the sweep"


class TrialRuns(tune.Callback):
    """On the driver: each trial's MLflow run has one writer that closes it. A trial that ran its
    course or failed closes its own run, after its records (raylane.onray.tune._trial); one that
    Tune ended while it ran (a scheduler's stop, or its process gone) writes nothing more, and is
    closed here, KILLED or FAILED, never FINISHED: a stopped trial's ranks are asked to stop at
    their next step-boundary vote (through the trial's event sink), and once rank 0 has ended (its
    buffered metrics sent) or is gone, what Tune judged it on is kept and the run is closed. That
    waits on a thread of its own, not on Tune's loop; `wait` joins them before the results are read."""

    def __init__(self, parent: RunHandle, sweep: SweepSection, max_epochs: int, stopping: Any = None) -> None:
        self.parent, self.sweep, self.max_epochs = parent, sweep, max_epochs
        self._closing: list[threading.Thread] = []
        self._stopping = stopping  # the sweep's SweepStopping actor (None: no trial asks it, as in unit tests)

    def _ended(self, trial, failed: bool) -> None:
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
            if run is None or run.info.status != "RUNNING":
                return  # closed by the trial itself, after its records
        except Exception as exc:  # noqa: BLE001 - records must not stop the sweep
            log.warning("MLflow: could not close trial %s: %s", trial.trial_id, exc)
            return
        if failed:  # its process is gone: closed now, before Tune may restart the trial in the same run
            self._close(client, run.info.run_id, trial.trial_id, result, failed)
            return
        stop_ranks(run.info.run_id)
        closing = threading.Thread(
            target=self._close, args=(client, run.info.run_id, trial.trial_id, result, failed), daemon=True
        )
        closing.start()
        self._closing.append(closing)

    def _close(self, client, run_id: str, trial_id: str, result: dict[str, Any], failed: bool) -> None:
        try:
            if not failed:
                wait_for_ranks(run_id, RANKS_STOP_S)
            epochs = result.get("epoch", 0)
            if stopped_early(failed, epochs, self.max_epochs):
                # Rank 0's buffered evaluation is sent when its run ends, and lost with it when Tune
                # kills the trial's process (no trial left to reuse it): kept here where it is missing.
                keep_stopped_trials_eval(client, run_id, result.get("step"), eval_metrics(result))
                client.set_tag(run_id, "raylane.early_stopped", "true")
                client.set_tag(run_id, "raylane.stopped_at_epoch", str(epochs))
            handle = RunHandle(run_id, self.parent.experiment_id, self.parent.tracking_uri, False)
            close_run(handle, Status.FAILED if failed else Status.KILLED)
        except Exception as exc:  # noqa: BLE001 - records must not stop the sweep
            log.warning("MLflow: could not close trial %s: %s", trial_id, exc)

    def wait(self, timeout_s: float = RANKS_STOP_S + 30) -> None:
        """Every stopped trial's run closed (each wait is bounded: this is too)."""
        deadline = time.monotonic() + timeout_s
        for closing in self._closing:
            closing.join(max(deadline - time.monotonic(), 0))

    def interrupted(self, stop_ray: Callable[[], None], timeout_s: float = INTERRUPT_STOP_S) -> Interrupted:
        """The sweep's driver was sent SIGTERM or Ctrl-C, and Tune's loop left where the signal
        found it. Each trial whose run is RUNNING has its ranks asked to stop at their next
        step-boundary vote with a checkpoint (as for Tune's stop), and its trial closes its run
        KILLED as a run that returned; the driver waits for the trials that have trained, within
        `timeout_s` (a second signal ends the wait; one sooner than SECOND_SIGNAL_S is the first's
        echo, ignored). Then Ray stops (`stop_ray`: every trial's process with an embedded
        cluster, or with the job of a joined one): what a trial still starting would write comes
        before that, so every run of the sweep still RUNNING after it is closed KILLED here, each
        tagged `interrupted`."""
        with _echoes_ignored():
            return self._interrupted(stop_ray, timeout_s)

    def _interrupted(self, stop_ray: Callable[[], None], timeout_s: float) -> Interrupted:
        if self._stopping is not None:
            try:  # before any trial's workers go: a trial whose launch fails from here on leaves its run to us
                ray.get(self._stopping.set.remote(), timeout=STOPPING_SET_S)
            except Exception as exc:  # noqa: BLE001 - a trial that cannot ask it leaves its run to us all the same
                log.warning("could not mark the sweep as stopping: %s", exc)
        client = mlflow_client(self.parent.tracking_uri)
        running, checkpointed = self._ask_to_stop(client, timeout_s)
        stop_ray()
        self.wait(CLOSING_JOIN_S)
        closed_here: list[str] = []
        try:
            for run_id in open_children(client, self.parent):
                handle = RunHandle(run_id, self.parent.experiment_id, self.parent.tracking_uri, False)
                close_run(handle, Status.KILLED, INTERRUPTED)
                closed_here.append(run_id)
            for run_id in running.difference(closed_here):  # closed by their trials, as runs that returned
                run = client.get_run(run_id)  # not one a scheduler's stop closed meanwhile
                if run.info.status == Status.KILLED and "raylane.early_stopped" not in run.data.tags:
                    client.set_tag(run_id, ERROR_TAG, INTERRUPTED)  # why, as on the runs closed here
        except Exception as exc:  # noqa: BLE001 - the parent run is closed all the same
            log.warning("MLflow: could not close the sweep's trial runs: %s", exc)
        return Interrupted(len(running.union(closed_here)), len(checkpointed))

    def _ask_to_stop(self, client, timeout_s: float) -> tuple[set[str], set[str]]:
        """Ask the ranks of every trial whose run is RUNNING to stop, and wait for those that have
        trained (a trial still starting has nothing to checkpoint: it is not waited for) until
        its trial has closed its run, or its ranks ended (or are gone) ENDED_GRACE_S ago; returns
        (the runs that were running, those whose ranks stopped with a checkpoint)."""
        started = time.monotonic()
        try:
            running = set(open_children(client, self.parent))
            trained = {run_id for run_id in running if has_trained(client, run_id)}
        except Exception as exc:  # noqa: BLE001 - Ray is stopped and the runs closed all the same
            log.warning("MLflow: could not list the sweep's running trials: %s", exc)
            return set(), set()
        for run_id in running:
            stop_ranks(run_id)
        waiting, checkpointed = set(trained), set()
        done_at: dict[str, float] = {}  # when a trial's ranks were seen ended, or not there
        while waiting and time.monotonic() < started + timeout_s:
            try:
                time.sleep(RANKS_POLL_S)
                for run_id in sorted(waiting):
                    state = ranks_state(run_id)
                    if state == "ended":
                        checkpointed.add(run_id)
                    now = time.monotonic()
                    if state != "training" and now - done_at.setdefault(run_id, now) >= ENDED_GRACE_S:
                        waiting.discard(run_id)
                closed = waiting - set(open_children(client, self.parent)) if waiting else set()
                checkpointed |= closed  # a trial closes its own run when its ranks returned: after a checkpoint
                waiting -= closed
            except KeyboardInterrupt:  # asked again (not the first's echo: _echoes_ignored)
                break  # what is still open is closed without waiting for it
            except Exception as exc:  # noqa: BLE001 - Ray is stopped and the runs closed all the same
                log.warning("while the sweep's trials stopped: %s", exc)
                break
        return running, checkpointed

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._ended(trial, failed=False)
        _tune_stop_pause()

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._ended(trial, failed=True)


@contextlib.contextmanager
def _echoes_ignored() -> Iterator[None]:
    """While a sweep's stop runs: SIGTERM and Ctrl-C within SECOND_SIGNAL_S of its start are the
    first signal's echo (a terminal's Ctrl-C beside a wrapper's SIGTERM), ignored; a later one is
    raised as the first was (raylane.session.raise_interrupt)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    started = time.monotonic()

    def second(signum: int, frame: Any) -> None:
        if time.monotonic() - started >= SECOND_SIGNAL_S:
            raise_interrupt(signum, frame)

    previous = {signum: signal.signal(signum, second) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stop_on_interrupt(
    sweep: SweepSection, parent: RunHandle, session: RunSession, trial_runs: TrialRuns, ray_stop: RayStopper
) -> SweepSummary:
    """SIGTERM or Ctrl-C while the trials run: every trial's run closed (`TrialRuns.interrupted`,
    which stops Ray through `ray_stop`), then the parent run,
    KILLED with the one line the terminal shows; returns the sweep's KILLED summary (exit 130)."""
    line = trial_runs.interrupted(ray_stop.wait).line(sweep.name)
    session.close(Status.KILLED, line)
    return SweepSummary(
        status=Status.KILLED,
        error=line,
        sweep=sweep.name,
        parent_run_id=parent.run_id,
        tracking_uri=parent.tracking_uri,
    )


def _tune_stop_pause() -> None:
    """For tests only: RAYLANE_TEST_TUNE_STOP_DELAY_S holds Tune's loop after a trial's end, before
    Tune stops the trial's process: Tune's stop reaching a stopped trial late, on purpose
    (tests/e2e/test_sweep_stops.py). A trial's ranks must not train on meanwhile."""
    if delay := os.environ.get(STOP_DELAY_ENV):
        time.sleep(float(delay))


@ray.remote(num_cpus=0)
class SweepStopping:
    """Set by the sweep's driver as its SIGTERM or Ctrl-C stop begins (`TrialRuns.interrupted`). A
    trial still starting then has nothing to stop at a step boundary: Ray's stop kills its workers
    and its launch fails with their loss, which is the sweep's stop, not the trial's failure. Seen
    in CI: such a trial closed its run FAILED, with no line, in the moment before Ray's stop
    reached its own process, and the driver (which closes only runs still RUNNING) left it so."""

    def __init__(self) -> None:
        self.stopping = False

    def set(self) -> None:
        self.stopping = True

    def get(self) -> bool:
        return self.stopping


def stopping_flag(parent_run_id: str) -> Any:
    """The sweep's SweepStopping actor, named for its parent run, for its trials to find."""
    return SweepStopping.options(name=f"raylane-sweep-stopping-{parent_run_id}").remote()  # type: ignore[attr-defined]


def sweep_stopping(parent_run_id: str, timeout_s: float = STOPPING_ASK_S) -> bool:
    """In a trial whose launch failed: whether the sweep's driver is stopping the sweep, or cannot
    be asked (its cluster going down with it). Either way the driver closes the trial's run: KILLED
    by its stop, or FAILED by Tune's report of the trial's error (`TrialRuns.on_trial_error`)."""
    try:
        actor = ray.get_actor(f"raylane-sweep-stopping-{parent_run_id}")
        return bool(ray.get(actor.get.remote(), timeout=timeout_s))
    except Exception:  # noqa: BLE001 - no answer: the cluster is going
        return True


def sink_name(run_id: str) -> str:
    """The event sink's name of the trial whose MLflow run is `run_id` (raylane.onray.launch)."""
    return f"raylane-trial-events-{run_id}"


def stop_ranks(run_id: str) -> None:
    """Ask the ranks of the trial recording `run_id` to stop: rank 0 reads the request from the
    trial's event sink, and every rank stops at the group's next step-boundary vote, with a
    checkpoint (raylane.loop.stopping). Nothing to do where the sink is gone already."""
    if not ray.is_initialized():
        return
    try:
        ray.get_actor(sink_name(run_id)).request_stop.remote()
    except ValueError:  # no such actor
        pass
    except Exception as exc:  # noqa: BLE001 - Tune's own stop still ends the trial, later
        log.warning("could not ask the stopped trial's ranks to stop: %s", exc)


def wait_for_ranks(run_id: str, timeout_s: float) -> None:
    """Until the trial's rank 0 has ended its run (its MLflow metrics sent), its event sink is
    gone (the trial's process ended or was killed, and its ranks with it), or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while ray.is_initialized() and time.monotonic() < deadline:
        if ranks_state(run_id, max(deadline - time.monotonic(), 0.1)) != "training":
            return
        time.sleep(RANKS_POLL_S)


def ranks_state(run_id: str, timeout_s: float = 5.0) -> str:
    """ "ended": the trial's rank 0 has ended its run (its MLflow metrics sent); "gone": its event
    sink is not there (its ranks not started yet, or its process ended or was killed, and its
    ranks with it), or does not answer within `timeout_s`; else "training"."""
    if not ray.is_initialized():
        return "gone"
    try:
        sink = ray.get_actor(sink_name(run_id))
        return "ended" if ray.get(sink.has_ended.remote(), timeout=timeout_s) else "training"
    except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return "gone"


def stopped_early(failed: bool, epochs: int, max_epochs: int) -> bool:
    """Whether Tune stopped a trial whose run it ended before the run did (a scheduler's or
    stopper's stop) short of its last epoch. A trial whose Train run returned closed that run
    itself: it ran its course, at max_epochs or at train.max_steps before it."""
    return not failed and epochs < max_epochs


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
