"""What rank 0 and the launchers tell the driver while a run goes on: one class per kind of event.

Senders, through `Runtime.publish` (Ray: raylane.onray.runtime's EventSink actor; torchrun and one
process: the driver's listeners, called directly):
- raylane.loop.reporting.Reporter (rank 0's Trainer): Start, FirstStep, Progress, Eval,
  Checkpoint, CheckpointFailed, Straggler, and at the end End, or Handover when the group restarts without
  a leaving node or for a larger group. With replica groups (raylane.loop.distributed.ft, through the
  Reporter): ReplicaHealed from the group that healed, ReplicaQuorum from the group that leads.
- raylane.autotuning.search (rank 0 of `raylane autotune`): SearchStart, Candidate, Round, SearchEnd.
- raylane.onray: Log (a worker's raylane warning: runtime), Startup (Ray's start-up phases, from
  the driver and Ray Train's controller: launch, trainers).

Readers, on the driver: raylane.tracking.progress.ProgressDisplay, raylane.tracking.records.
RunRecorder, raylane.tracking.resizes.Resizes, raylane.loop.observe.startup.StartupTimes, Tune's trial
(raylane.onray.tune: Checkpoint), autotune's Recorder (raylane.autotuning.driver), and the Ray
launcher itself (End's result, Handover). A training run's result is a RunResult, a search's a
SearchResult of each candidate's Outcome (raylane.loop.protocols.result).

Plain frozen dataclasses: on Ray they cross the event actor by pickling, and this module, like
the rest of the loop, imports neither Ray nor torch (the driver reads startup events before
either is loaded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raylane.loop.protocols.result import Outcome, RunResult, SearchResult


@dataclass(frozen=True, slots=True)
class Start:
    """A worker group started training (each restart sends one again)."""

    total_steps: int
    steps_per_epoch: int
    max_epochs: int
    world_size: int
    host: str  # rank 0's
    resumed_from_step: int | None = None
    resumed_from: str | None = None  # the checkpoint's name
    resumed_layout: str | None = None  # `resuming a tp2 checkpoint of 2 ranks as ddp on 4`, at another layout
    skipped_checkpoints: list[dict[str, str]] = field(default_factory=list)  # newer ones passed over: path, reason
    strategy: str | None = None
    strategy_reason: str = ""
    strategy_tags: dict[str, str] = field(default_factory=dict)  # MLflow tags
    startup: dict[str, float] = field(
        default_factory=dict
    )  # start-up phase -> unix time (raylane.loop.observe.startup)


@dataclass(frozen=True, slots=True)
class FirstStep:
    """The group's first optimizer step is done."""

    step: int
    time_unix: float
    startup: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Progress:
    """Rate-limited (raylane.loop.reporting.PROGRESS_INTERVAL_S)."""

    epoch: int
    step: int
    window: dict[str, Any] | None = None  # the last train metrics' steps and figures: first_step, last_step, loss, ...
    # The rest of rank 0's state as the display keeps it: Start's figures and the latest train metrics (loss, lr, ...).
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Eval:
    epoch: int
    step: int
    metrics: dict[str, float]
    epoch_end: bool = True  # False part-way through an epoch (train.eval_every_n_steps)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint committed to storage."""

    step: int
    location: str
    epoch: int
    metrics: dict[str, float]  # the eval metrics measured at this step, else empty
    speed: dict[str, float]  # rank 0's throughput over the epoch, else empty
    time_unix: float


@dataclass(frozen=True, slots=True)
class CheckpointFailed:
    step: int
    error: str


@dataclass(frozen=True, slots=True)
class Log:
    """A worker's raylane warning (Ray relays no worker output to a driver that shows only raylane's lines)."""

    rank: int
    level: str  # "warning", "error", ...
    message: str


@dataclass(frozen=True, slots=True)
class Straggler:
    """A rank named as slow by its step times, once (raylane.loop.observe.steptimes)."""

    record: dict[str, Any]  # raylane.loop.observe.steptimes.Straggler.to_dict()
    line: str  # what the terminal says


@dataclass(frozen=True, slots=True)
class ReplicaHealed:
    """Replica group `group` healed from a live peer (raylane.loop.distributed.ft): it took step
    `step` with its peers' state and gradients (its own count from the next step), its own state
    having been at step `from_step` (its checkpoint's, or 0), the copy done `seconds` into that step."""

    group: int
    step: int
    from_step: int
    seconds: float


@dataclass(frozen=True, slots=True)
class ReplicaQuorum:
    """The replica groups taking part changed, as the leading group (the lowest alive) saw it:
    from step `step`, `alive` of the run's `groups` step together."""

    step: int
    alive: int
    groups: int


@dataclass(frozen=True, slots=True)
class Handover:
    """The group checkpointed and stops for a restart: a node is leaving, or a larger group fits."""

    time_unix: float
    result: RunResult


@dataclass(frozen=True, slots=True)
class End:
    """Rank 0's result of a training run (Trainer.train)."""

    time_unix: float
    result: RunResult


@dataclass(frozen=True, slots=True)
class Startup:
    """Start-up phases that end outside rank 0: on Ray, `fit` (the driver) and `controller`; and
    when the processes of the run's actors started (`processes`: "controller", "event sink",
    "rank N"), which says whether each was a warm worker (started before the run)."""

    phases: dict[str, float]
    processes: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SearchStart:
    time_unix: float


@dataclass(frozen=True, slots=True)
class Candidate:
    """One autotune candidate measured (or replayed from an earlier launch's record)."""

    index: int
    replayed: bool
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Round:
    """Candidate `index` measured once more; `outcome` is its rounds merged."""

    index: int
    rounds: int | None
    replayed: bool
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class SearchEnd:
    """Rank 0's result of an autotune search: every candidate's outcome, in order."""

    time_unix: float
    result: SearchResult


Event = (
    Start
    | FirstStep
    | Progress
    | Eval
    | Checkpoint
    | CheckpointFailed
    | Log
    | Straggler
    | ReplicaHealed
    | ReplicaQuorum
    | Handover
    | End
    | Startup
    | SearchStart
    | Candidate
    | Round
    | SearchEnd
)
