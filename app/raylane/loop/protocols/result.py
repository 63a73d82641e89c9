"""What a training run hands back when its loop ends: rank 0's `RunResult`, carried to the driver by
the `End` event (or `Handover`, when the group restarts), read by attribute. Built by the Trainer
(`Trainer._result`); rank 0's Reporter adds what it alone knows (`Reporter.on_end`, through
`dataclasses.replace`). The driver's summary (raylane.results.TrainSummary) is built from its
attributes. A frozen dataclass: it pickles across Ray's event actor, and neither torch nor Ray is
imported here."""

from __future__ import annotations

from dataclasses import dataclass
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
    mfu: float | None = None  # with a known peak of the device
    # Rank 0's Reporter adds these (Reporter.on_end):
    last_window: dict[str, Any] | None = None  # the last logged steps' train figures
    steps_per_epoch: int | None = None
    tracking_cost_s: dict[str, float] | None = None  # what logging to MLflow cost rank 0
    # Rank 0's, from every rank's step times (raylane.loop.observe.steptimes):
    stragglers: list[dict[str, Any]] | None = None  # each rank named as slow (Straggler.to_dict)
    rank_times: list[dict[str, Any]] | None = None  # each rank's step times over the run (RankTable.rows)

    def rates(self) -> dict[str, float]:
        """The whole run's throughput, as MLflow records it (run/<name>): samples a second, and
        tokens a second for a language model."""
        rates = {"samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s}
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
