"""What a launch's ranks hand back when their loop ends, read by attribute on the driver.

- A training run: rank 0's `RunResult`, carried by the `End` event (or `Handover`, when the group
  restarts). Built by the Trainer (`Trainer._result`); rank 0's Reporter adds what it alone knows
  (`Reporter.on_end`, through `dataclasses.replace`). The driver's summary
  (raylane.results.TrainSummary) is built from its attributes.
- An autotune search (raylane.autotuning.search): each candidate's `Outcome` (and the `Fit` it
  ended with), carried by the `Candidate` and `Round` events, and the whole `SearchResult` by
  `SearchEnd`. Here, below the events, because they cross processes in them.

Frozen dataclasses: they pickle across Ray's event actor, and neither torch nor Ray is imported
here."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any


@dataclass(frozen=True, slots=True)
class RunResult:
    """One launch's training, from its loop. Throughput figures leave out the warm-up steps when
    the launch was long enough (Trainer._result); times are rank 0's."""

    steps: int  # optimizer steps taken, over every launch of the run
    epochs: int  # whole epochs trained
    partial_epoch: float  # the share of the running epoch trained (a stop mid-epoch)
    step_time_s: float
    samples_per_s: float  # over the whole group
    train_s: float  # from the start of training (or the warm-up's end) to the end of the loop
    train_wall_s: float  # every launch's training time, warm-up steps included (time to a target)
    train_cpu_s: float  # this process's CPU time over train_s's span
    checkpoint_stall_s: float  # time the loop waited on checkpoints before its last step
    epoch_end_s: list[float]  # seconds from the start of training to the end of each epoch's end work
    metrics: dict[str, float]  # the last evaluation's
    memory: dict[str, int]  # the largest figures over the ranks: state_bytes_per_rank, peak_bytes
    strategy: str
    mesh: list[int]
    node_ranks: list[int] | None  # each rank's node, where the launcher knows it
    world_size: int
    backend: str  # the process group's: nccl or gloo
    resumed_from_step: int | None
    checkpoint: str | None  # the newest committed by this launch, or the one it resumed from
    skipped_steps: int  # non-finite updates skipped (train.on_nan: skip)
    skipped_rows: dict[str, Any]  # bad rows this process skipped, by the config key of their files
    failed_checkpoints: int  # saves that failed (checkpoint.on_error: warn)
    preempted: bool  # stopped on request, with a checkpoint to resume from
    node_leaving: bool  # ... for a restart without a leaving node
    growing: bool  # ... for a restart with a larger group
    stop_reason: str | None  # why the loop ended before its last step
    early_stopped: bool  # train.early_stopping ended the run
    tokens_per_s: float | None = None  # language models (Pipeline.tokens_per_sample)
    real_tokens_per_s: float | None = None  # ... of them, those that were data (Pipeline.real_tokens)
    packing_efficiency: float | None = None  # the tokens that were data, of every row's (rank 0's)
    mfu: float | None = None  # with a known peak of the device
    # Rank 0's Reporter adds these (Reporter.on_end):
    last_window: dict[str, Any] | None = None  # the last logged steps' train figures
    steps_per_epoch: int | None = None
    tracking_cost_s: dict[str, float] | None = None  # what logging to MLflow cost rank 0
    # With replica groups (raylane.loop.distributed.ft): groups, heals (this group's), steps_below_full
    # (steps this group took with fewer groups than the run has).
    replicas: dict[str, int] | None = None
    # Rank 0's, from every rank's step times (raylane.loop.observe.steptimes):
    stragglers: list[dict[str, Any]] | None = None  # each rank named as slow (Straggler.to_dict)
    rank_times: list[dict[str, Any]] | None = None  # each rank's step times over the run (RankTable.rows)
    # With expert parallelism: the run's tokens per expert over every rank (raylane.loop.observe.experts).
    experts: dict[str, Any] | None = None

    def rates(self) -> dict[str, float]:
        """The whole run's throughput, as MLflow records it (run/<name>): samples a second, and
        tokens a second for a language model (and of them the data's, with its packing efficiency,
        for rows that hold padding)."""
        rates = {
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "real_tokens_per_s": self.real_tokens_per_s,
            "packing_efficiency": self.packing_efficiency,
        }
        return {name: float(value) for name, value in rates.items() if value is not None}

    def speed(self) -> dict[str, float]:
        """The whole run's throughput under the names of each epoch's (Trainer._epoch_speed), as
        a sweep's trial reports it."""
        speed = {
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "step_time_s": self.step_time_s,
            "peak_memory_bytes": self.memory.get("peak_bytes"),
            "train_s": self.train_wall_s,  # every launch's, as a time-to-target objective counts
        }
        return {name: float(value) for name, value in speed.items() if value is not None}


class Fit(StrEnum):
    """How an autotune candidate (or one of its rounds) ended. The value is what the summary, the
    table and the child run's `raylane.autotune.status` tag show."""

    OK = "ok"  # measured
    OOM = "oom"  # out of memory on some rank (agreed by all)
    FAILED = "failed"  # another error, or its worker group died while profiling it
    PRUNED = "pruned"  # rank 0's memory estimate said it would not fit: never run


@dataclass(frozen=True, slots=True)
class Outcome:
    """An autotune candidate's figures: its first round, or its rounds merged
    (raylane.autotuning.ranking). None: not measured (a candidate that did not run, or a figure
    this pipeline has none of). Built on the ranks, read by the search order, the ranking and
    the driver's report; written to the search's record as `to_dict()`."""

    values: dict[str, Any]  # the searched keys (dotted) and the values this candidate tried
    status: Fit = Fit.OK
    error: str | None = None
    grad_accum_steps: int | None = None
    samples_per_s: float | None = None  # the median of all its windows
    interval: list[float] | None = None  # [low, high] around that median
    windows: list[list[float]] | None = None  # samples/s of each window, a list per round
    window_s: list[list[float]] | None = None  # the seconds each window lasted
    rounds: int | None = None
    samples_per_step: int | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    estimated_bytes: int | None = None  # rank 0's estimate, before anything ran
    unreleased_bytes: int | None = None  # still allocated after its teardown (GPU)
    profile_s: float | None = None
    setup_s: float | None = None
    eval_s: float | None = None
    save_s: float | None = None
    steps_per_epoch: int | None = None
    pid: int | None = None
    replayed: bool = False  # from an earlier launch's record, not measured by this one
    final: bool = False  # a later round failed: no more rounds
    round_error: str | None = None  # that round's error

    @property
    def ok(self) -> bool:
        """Measured: it has a figure to rank."""
        return self.status == Fit.OK and self.samples_per_s is not None

    def to_dict(self) -> dict[str, Any]:
        """The record's form (JSON): `status` as its value, flags only when set."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["status"] = self.status.value
        for flag in ("replayed", "final"):
            if not out[flag]:
                del out[flag]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        """Back from to_dict() (a record an earlier launch wrote); ValueError naming a key it does
        not know, rather than a figure silently lost."""
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"an autotune outcome with unknown keys {unknown}")
        return cls(**{"values": {}, **data, "status": Fit(data.get("status", Fit.OK))})


@dataclass(frozen=True, slots=True)
class SearchResult:
    """One autotune search, from its ranks (raylane.autotuning.search.Search.run)."""

    candidates: list[Outcome]  # every candidate's outcome, its rounds merged, in the order tried
    wall_s: float
    world_size: int
    estimate_margin: float  # autotune.safety_margin, as the memory estimates were pruned with
    device: str  # the ranks' device type: cpu or cuda
