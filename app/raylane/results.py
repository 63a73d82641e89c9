"""What each command returns and writes with `--summary-json`: typed, documented and versioned.

Scripts and CI read these files, so a field is never renamed, retyped or dropped without a new
`SCHEMA_VERSION` (tests/unit/test_results.py holds each released version's fingerprint). Every
summary carries its `schema_version` and its `command`; `docs/summary.md` and
`docs/summary.schema.json` are generated from the models below (`make docs`)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION: Final = 8


class Status(str, Enum):
    """How a command ended: MLflow's run statuses, and the command's exit code."""

    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"

    __str__ = str.__str__  # f"{status}" is the value, on every Python raylane supports

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self]


# The one exit-code table: 130 is a shell's code for an interrupt (Ctrl-C, or SIGTERM here).
EXIT_CODES = {Status.FINISHED: 0, Status.FAILED: 1, Status.KILLED: 130}
# A Ray job's terminal states (`raylane submit --follow`) as raylane's statuses.
JOB_STATUSES = {"SUCCEEDED": Status.FINISHED, "FAILED": Status.FAILED, "STOPPED": Status.KILLED}


class _Model(BaseModel):
    # Unknown keys are refused: a misspelt field fails where the summary is built, not as a
    # silent None in a user's script.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_enum_values=False)


class _Summary(_Model):
    schema_version: Literal[8] = Field(SCHEMA_VERSION, description="This file's schema version.")
    status: Status = Field(description="FINISHED, FAILED or KILLED; the exit code is 0, 1 or 130.")
    error: str | None = Field(None, description="Why the command did not finish: one line, else null.")

    def to_json(self) -> str:
        return self.model_dump_json(indent=2, by_alias=True) + "\n"

    def write(self, path: str | Path | None) -> None:
        """Write the summary where `--summary-json` asked (no-op for None)."""
        if path:
            Path(path).write_text(self.to_json())

    @property
    def exit_code(self) -> int:
        return self.status.exit_code


# -- raylane train ----------------------------------------------------------------------------


class SkippedCheckpoint(_Model):
    path: str = Field(description="A checkpoint newer than the one the run resumed from.")
    reason: str = Field(description="Why the resume passed it over (a missing or damaged file).")


class SkippedRows(_Model):
    rows: int = Field(description="Rows read (before any was skipped).")
    skipped: int = Field(description="Bad rows skipped: each counted once, however many epochs read it.")
    first: str | None = Field(None, description="The first row skipped: its file, row, column and value.")
    counts: dict[str, int] = Field(
        default_factory=dict,
        description="What the data's transform counted before training, by what it is: the hf pipeline's "
        "examples cut to model.seq_len, dropped past it, and conversations without an answer, left out.",
    )


class Memory(_Model):
    state_bytes_per_rank: int = Field(description="Parameters, gradients and optimizer state one rank holds.")
    peak_bytes: int = Field(description="Peak device memory (GPU) or peak resident memory of the process (CPU).")


class Window(_Model):
    first_step: int = Field(description="The window's first step.")
    last_step: int = Field(description="The window's last step.")
    loss: float | None = Field(None, description="Mean train loss over the window.")
    samples_per_s: float | None = Field(None, description="Rank 0's samples a second over the window, whole group.")
    tokens_per_s: float | None = Field(None, description="Tokens a second over the window (token pipelines).")
    real_tokens_per_s: float | None = Field(
        None, description="Of them, the tokens that were data, not padding (rows that hold padding)."
    )
    padding_share: float | None = Field(None, description="The share of the window's tokens that were padding.")


class TrackingCost(_Model):
    log_calls_s: float = Field(description="Seconds the training thread spent in logging calls.")
    sender_cpu_s: float = Field(description="CPU seconds of the thread that sends metrics to MLflow.")
    system_metrics_cpu_s: float = Field(description="CPU seconds of MLflow's system-metrics thread.")


class Timing(_Model):
    launched_unix: float = Field(description="When the launch started (Unix time).")
    first_step_unix: float | None = Field(None, description="When rank 0 took the run's first step.")
    last_step_unix: float | None = Field(None, description="When rank 0 took the run's last step.")
    launch_to_first_step_s: float | None = Field(None, description="Seconds from the launch to the first step.")
    restart_first_step_unix: list[float] = Field(
        default_factory=list, description="When each restarted worker group took its first step."
    )
    startup: dict[str, float] = Field(
        default_factory=dict,
        description="Seconds from the launch to the end of each start-up phase "
        "(raylane.loop.observe.startup.PHASES: ray_init, worker_imports, first_step, ...).",
    )
    startup_origin_unix: float | None = Field(None, description="The instant `startup`'s seconds count from.")
    warm_actors: dict[str, bool] = Field(
        default_factory=dict,
        description="On Ray: whether each of the run's actors (controller, event sink, rank N) started on a warm "
        "worker, a process a `raylane up` head had ready before the run joined.",
    )


class Resize(_Model):
    step: int = Field(description="The step the resized group resumed from.")
    from_: int = Field(alias="from", description="Workers before.")
    to: int = Field(description="Workers after.")
    reason: str = Field(description="Why: a worker or node lost, a node's notice, or more workers fitting.")
    steps_lost: int = Field(description="Steps the group before had reported past that checkpoint.")
    time_lost_s: float = Field(description="From the group before's last report to the new group's first step.")


class ReplicaGroups(_Model):
    groups: int = Field(description="The run's replica groups (fault_tolerance.replica_groups).")
    heals: int = Field(description="Times a group rejoined by copying a live group's state (after a restart).")
    longest_heal_s: float | None = Field(None, description="The longest heal: seconds of the copy.")
    fewest_alive: int = Field(description="The fewest groups that stepped together.")
    steps_below_full: int = Field(description="Steps taken with fewer groups than the run has.")


class Straggler(_Model):
    rank: int = Field(description="The rank named as slow.")
    node: str = Field(description="Its node's host name.")
    step: int = Field(description="The step of the window that named it.")
    ratio: float = Field(description="Its busy step time over the other ranks' median, in that window.")
    step_s: float = Field(description="Its busy step time (its step less its wait for the others at the sync).")
    median_s: float = Field(description="The other ranks' median busy step time.")
    data_share: float = Field(description="The share of its busy step it waited on its data.")
    data_bound: bool = Field(description="It waits on data for half its step or more: its input is slow.")
    windows: int = Field(description="Windows running it was slow in (stragglers.windows).")


class Experts(_Model):
    modules: int = Field(description="The experts modules laid out by expert (one a layer, usually).")
    experts: int = Field(description="Experts in each of them (the most of any).")
    ep: int = Field(description="The expert-parallel degree: ranks one model's experts are split over.")
    capacity_factor: float | None = Field(
        None, description="strategy.ep_capacity_factor (null: no capacity, no pair dropped)."
    )
    routed: int = Field(description="(token, expert) pairs the routers chose over the run, every rank's.")
    tokens_min: int = Field(description="The fewest pairs one expert was sent over the run (every rank's).")
    tokens_max: int = Field(description="The most pairs one expert was sent over the run (every rank's).")
    imbalance: float | None = Field(
        None, description="The worst module's most loaded expert over its mean (1: even; null: nothing routed)."
    )
    dropped: int = Field(description="Pairs the capacity dropped (their output 0), every rank's.")


class RegisteredModel(_Model):
    name: str = Field(description="The registered model's name (`--register NAME`).")
    version: str | int | None = Field(None, description="The version this run registered.")


class TrainSummary(_Summary):
    """`raylane train --summary-json`, and what `raylane.train()` returns."""

    command: Literal["train"] = Field("train", description="The command that wrote it.")
    already_finished: bool = Field(
        False,
        description="The run had already reached the end asked for: nothing was trained, this is its earlier summary.",
    )
    run_name: str = Field(description="run.name: the run's folder under run.storage_path and its MLflow run name.")
    run_id: str | None = Field(None, description="The MLflow run id (null: MLflow off or unreachable).")
    tracking_uri: str | None = Field(None, description="The MLflow tracking URI the run was recorded at.")
    experiment: str | None = Field(None, description="The MLflow experiment.")
    checkpoint: str | None = Field(None, description="The newest valid checkpoint: the one a relaunch resumes from.")
    skipped_checkpoints: list[SkippedCheckpoint] = Field(
        default_factory=list, description="Newer checkpoints a resume passed over, and why."
    )
    world_size: int | None = Field(None, description="Workers (ranks) at the end.")
    backend: str | None = Field(None, description="The process group's backend: nccl or gloo.")
    strategy: str | None = Field(
        None,
        description="ddp, fsdp, hsdp or single (one rank); with tensor or pipeline parallelism the layout: "
        "`fsdp×tp2×pp2`, or `tp2`, `pp2` with one data-parallel rank (`+sp`, `+lp`: sequence and loss parallel).",
    )
    mesh: list[int] | None = Field(
        None,
        description="The device mesh's shape (FSDP: [shard] or [replicate, shard]; with tensor or pipeline "
        "parallelism [pp, dp_replicate, dp_shard, cp, tp]).",
    )
    node_ranks: list[int] | None = Field(None, description="Each rank's node, numbered in rank order (Ray runs).")
    epochs: int | None = Field(None, description="Whole epochs trained.")
    partial_epoch: float | None = Field(None, description="The fraction of an epoch a stop left unfinished.")
    steps: int | None = Field(None, description="Optimizer steps taken, over every launch of the run.")
    steps_per_epoch: int | None = Field(None, description="Optimizer steps in one epoch.")
    resumed_from_step: int | None = Field(None, description="The checkpoint's step this launch resumed from.")
    metrics: dict[str, float] = Field(default_factory=dict, description="The last evaluation's metrics (eval/*).")
    last_window: Window | None = Field(
        None, description="Train loss and throughput over the last logged steps (MLflow's last train/* values)."
    )
    wall_s: float | None = Field(None, description="Seconds from the launch to the summary.")
    samples_per_s: float | None = Field(None, description="Samples a second over the whole training, whole group.")
    tokens_per_s: float | None = Field(None, description="Tokens a second over the whole training.")
    real_tokens_per_s: float | None = Field(
        None, description="Of them, the tokens that were data, not padding (packed or padded rows)."
    )
    packing_efficiency: float | None = Field(
        None, description="The tokens that were data, of every row's tokens (rank 0's, this launch): 1 is no padding."
    )
    mfu: float | None = Field(None, description="Model FLOPs utilisation (GPU runs with a known peak).")
    train_s: float | None = Field(
        None, description="Rank 0's seconds from the start of training to the end of its loop."
    )
    train_cpu_s: float | None = Field(None, description="Rank 0's process CPU seconds over the same span.")
    checkpoint_stall_s: float | None = Field(None, description="Seconds rank 0's loop waited on checkpoint saves.")
    epoch_end_s: list[float] | None = Field(
        None, description="Seconds from the start of training to the end of each epoch's evaluation and save."
    )
    memory: Memory | None = Field(None, description="The largest figures over the ranks.")
    restarts: int = Field(0, description="Restarts of the worker group (a failure, a resize).")
    resizes: list[Resize] = Field(default_factory=list, description="An elastic run's changes of world size.")
    replicas: ReplicaGroups | None = Field(
        None, description="With fault_tolerance: the replica groups' heals and the steps taken below full strength."
    )
    skipped_steps: int = Field(0, description="Steps skipped for a non-finite loss (train.on_nan: skip).")
    skipped_rows: dict[str, SkippedRows] = Field(
        default_factory=dict,
        description="Bad rows skipped (data.skip_bad_rows), and what the data's transform counted, by the config "
        "key of their files (`data.train`), or `<name> dataset` for a dataset handed over in memory.",
    )
    failed_checkpoints: int = Field(
        0, description="Checkpoint saves that failed (checkpoint.on_error: warn; the run went on)."
    )
    preempted: bool = Field(
        False, description="Stopped on request (a signal, a node's notice) with a checkpoint to resume from."
    )
    stop_reason: str | None = Field(None, description="Why training ended before its last step.")
    early_stopped: bool = Field(False, description="train.early_stopping ended the run (FINISHED).")
    tracking_cost_s: TrackingCost | None = Field(None, description="What logging to MLflow cost rank 0.")
    experts: Experts | None = Field(
        None,
        description="With expert parallelism (strategy.ep > 1): the run's tokens per expert over every rank, and "
        "the pairs a capacity dropped (each window's, rank 0's: train/experts/* in MLflow).",
    )
    stragglers: list[Straggler] = Field(
        default_factory=list,
        description="Ranks named as slow by their step times (stragglers.factor, stragglers.windows), each once.",
    )
    profile_traces: list[str] = Field(
        default_factory=list, description="The profiled ranks' traces (profile.enabled): gzipped Chrome trace JSON."
    )
    memory_snapshots: list[str] = Field(
        default_factory=list,
        description="The profiled ranks' CUDA memory snapshots (profile.memory_snapshot_step, memory_snapshot_on_oom): "
        "pickles https://pytorch.org/memory_viz opens.",
    )
    timing: Timing | None = Field(None, description="When things happened.")
    model_uri: str | None = Field(None, description="The MLflow model logged from the final checkpoint.")
    registered_model: RegisteredModel | None = Field(None, description="Where `--register` put it.")


# -- raylane tune -----------------------------------------------------------------------------


class Trial(_Model):
    trial_id: str = Field(description="Ray Tune's trial id.")
    config: dict[str, Any] = Field(description="The trial's values of the searched keys.")
    metrics: dict[str, float | int | None] = Field(description="The sweep's metric, epoch and step at its last report.")
    status: str = Field(description="The trial's MLflow run status (FINISHED, FAILED, KILLED), else ERROR or UNKNOWN.")
    early_stopped: bool = Field(description="Stopped early by the scheduler or train.early_stopping.")
    exploits: int = Field(description="Times PBT replaced its weights and values with a better trial's.")
    run_id: str | None = Field(None, description="The trial's nested MLflow run.")
    checkpoint: str | None = Field(None, description="Its last reported checkpoint.")
    time_s: float | None = Field(None, description="The trial's seconds, Tune's time_total_s.")
    error: str | None = Field(None, description="Why it failed.")


class BestTrial(_Model):
    trial_id: str = Field(description="The best trial's id.")
    config: dict[str, Any] = Field(description="Its values of the searched keys.")
    metric: float = Field(description="Its value of the sweep's metric.")
    run_id: str | None = Field(None, description="Its MLflow run.")
    checkpoint: str | None = Field(None, description="Its last checkpoint.")


class SweepTiming(_Model):
    wall_s: float = Field(description="The sweep's seconds.")
    trial_s_sum: float = Field(description="The trials' seconds, summed.")
    ideal_s: float = Field(description="trial_s_sum over concurrency: every trial's time perfectly packed.")


class SweepSummary(_Summary):
    """`raylane tune --summary-json`, and what `raylane.tune()` returns."""

    command: Literal["tune"] = Field("tune", description="The command that wrote it.")
    already_finished: bool = Field(False, description="The sweep had already finished: nothing ran.")
    sweep: str = Field(description="sweep.name.")
    parent_run_id: str | None = Field(None, description="The sweep's MLflow parent run.")
    tracking_uri: str | None = Field(None, description="The MLflow tracking URI.")
    concurrency: int | None = Field(None, description="Trials run at a time.")
    best: BestTrial | None = Field(None, description="The best trial by sweep.metric and sweep.mode.")
    trials: list[Trial] = Field(default_factory=list, description="Every trial, by id.")
    timing: SweepTiming | None = Field(None, description="The sweep's seconds.")
    model_uri: str | None = Field(None, description="The best trial's MLflow model, on the parent run.")
    registered_model: RegisteredModel | None = Field(None, description="Where `--register` put it.")


# -- raylane autotune -------------------------------------------------------------------------


class Candidate(_Model):
    config: dict[str, Any] = Field(description="The candidate's values of the searched keys.")
    status: Literal["ok", "oom", "pruned", "failed"] = Field(
        description="ok; oom (out of memory); pruned (its memory estimate did not fit: never run); failed."
    )
    verdict: Literal["winner", "tie", "slower"] | None = Field(None, description="Its place in the ranking.")
    samples_per_s: float | None = Field(None, description="Median samples a second over its windows.")
    interval: list[float] | None = Field(None, description="The median's bootstrap interval [low, high].")
    rounds: int | None = Field(None, description="Rounds it was measured in.")
    windows: list[list[float]] | None = Field(None, description="Samples a second of each window, by round.")
    window_s: list[list[float]] | None = Field(None, description="Seconds of each window, by round.")
    tokens_per_s: float | None = Field(None, description="Tokens a second (token pipelines).")
    grad_accum_steps: int | None = Field(None, description="Micro-batches per step that hold the global batch.")
    peak_memory_bytes: int | None = Field(None, description="Measured peak (GPU) or resident growth (CPU).")
    estimated_bytes: int | None = Field(None, description="The memory estimate that admitted it.")
    eval_s: float | None = Field(None, description="Seconds of one evaluation batch.")
    save_s: float | None = Field(None, description="Seconds of a checkpoint save.")
    profile_s: float | None = Field(None, description="Seconds spent measuring it.")
    setup_s: float | None = Field(None, description="Seconds to build and parallelize it.")
    error: str | None = Field(None, description="Why it did not run.")
    pid: int | None = Field(None, description="The process that measured it.")
    run_id: str | None = Field(None, description="Its nested MLflow run.")


class AutotuneBest(_Model):
    candidate: int = Field(description="The winner's index in candidates.")
    config: dict[str, Any] = Field(description="Its values, with train.grad_accum_steps.")
    samples_per_s: float = Field(description="Its median samples a second.")
    interval: list[float] | None = Field(None, description="The median's bootstrap interval.")
    rounds: int | None = Field(None, description="Rounds it was measured in.")
    tied_with: list[int] = Field(default_factory=list, description="Candidates within the noise of it.")
    tokens_per_s: float | None = Field(None, description="Tokens a second.")
    mfu: float | None = Field(None, description="Model FLOPs utilisation (GPU).")
    peak_memory_bytes: int | None = Field(None, description="Its measured peak memory.")
    yaml: str = Field(description="The ready-to-train YAML written (`--out`).")


class Ranking(_Model):
    winner: int = Field(description="The simplest candidate tied with the leader.")
    leader: int = Field(description="The candidate with the highest median.")
    ties: list[int] = Field(description="Candidates whose intervals overlap the leader's.")
    clear: bool = Field(description="The winner had no tie.")
    confidence: float = Field(description="The bootstrap intervals' confidence.")
    windows: int = Field(description="Windows measured per round.")
    min_rounds: int = Field(description="Rounds before a candidate can be ruled out.")
    max_rounds: int = Field(description="Rounds at most.")


class AutotuneTiming(_Model):
    wall_s: float = Field(description="The search's seconds.")
    startup_s: float | None = Field(None, description="Seconds before the first candidate started.")
    profiling_s: float = Field(description="Seconds spent measuring candidates.")


class AutotuneSummary(_Summary):
    """`raylane autotune --summary-json`, and what `raylane.autotune()` returns."""

    command: Literal["autotune"] = Field("autotune", description="The command that wrote it.")
    run_name: str = Field(description="The search's MLflow parent run name.")
    parent_run_id: str | None = Field(None, description="The search's MLflow parent run.")
    tracking_uri: str | None = Field(None, description="The MLflow tracking URI.")
    global_batch: int | None = Field(None, description="The samples per step every candidate held.")
    world_size: int | None = Field(None, description="Workers in the group measured.")
    device: str | None = Field(None, description="cpu or cuda.")
    best: AutotuneBest | None = Field(None, description="The candidate chosen (null: none fitted).")
    ranking: Ranking | None = Field(None, description="How it was chosen.")
    candidates: list[Candidate] = Field(default_factory=list, description="Every candidate, in the order tried.")
    estimate_error: float | None = Field(None, description="Median of measured peak over estimate, minus 1 (GPU).")
    timing: AutotuneTiming | None = Field(None, description="The search's seconds.")


# -- raylane submit and raylane export --------------------------------------------------------


class SubmitSummary(_Summary):
    """`raylane submit --follow --summary-json`: the job's end."""

    command: Literal["submit"] = Field("submit", description="The command that wrote it.")
    job_id: str = Field(description="The Ray job's id.")
    address: str = Field(description="The cluster's jobs API address.")
    job_status: str | None = Field(None, description="Ray's status for the job: SUCCEEDED, FAILED or STOPPED.")
    run_id: str | None = Field(None, description="The MLflow run the job recorded into.")
    run_name: str | None = Field(None, description="run.name (null: the job named it; see run_id).")
    tracking_uri: str | None = Field(None, description="Where the job records its MLflow run (null: MLflow off).")
    experiment: str | None = Field(None, description="The MLflow experiment.")
    storage_path: str | None = Field(None, description="run.storage_path: the run's checkpoints are under it.")


class ExportSummary(_Summary):
    """`raylane export --summary-json`."""

    command: Literal["export"] = Field("export", description="The command that wrote it.")
    checkpoint: str = Field(description="The checkpoint exported (a run folder's newest valid one).")
    format: Literal["safetensors", "hf"] = Field(description="safetensors (one file) or hf (a save_pretrained folder).")
    adapter_only: bool = Field(False, description="A LoRA run's adapter alone.")
    out: str = Field(description="The file or folder written.")
    files: list[str] = Field(description="Every file written, as absolute paths.")


SUMMARIES: dict[str, type[_Summary]] = {
    "train": TrainSummary,
    "tune": SweepSummary,
    "autotune": AutotuneSummary,
    "submit": SubmitSummary,
    "export": ExportSummary,
}


def read_summary(path: str | Path) -> _Summary:
    """A `--summary-json` file as its typed summary (any command's)."""
    data = json.loads(Path(path).read_text())
    return SUMMARIES[data["command"]].model_validate(data)


def outline() -> dict[str, dict[str, str]]:
    """Every summary's fields and those of the models they hold: name -> type and default. What a
    schema version fixes (tests/unit/test_results.py fingerprints it), independent of pydantic's own
    JSON Schema output, which may change between its releases."""
    out: dict[str, dict[str, str]] = {}
    queue: list[type[BaseModel]] = list(SUMMARIES.values())
    while queue:
        model = queue.pop(0)
        if model.__name__ in out:
            continue
        out[model.__name__] = {
            field.alias or name: f"{_type_name(field.annotation)} = "
            f"{'required' if field.is_required() else repr(field.get_default(call_default_factory=True))}"
            for name, field in model.model_fields.items()
        }
        queue += [m for f in model.model_fields.values() for m in models_in(f.annotation)]
    return out


def _type_name(annotation: Any) -> str:
    """`list[Window] | None`: without module paths, which a move of a module would change."""
    import re

    text = re.sub(r"<(?:class|enum) '(?:[\w.]+\.)?(\w+)'>", r"\1", repr(annotation))
    return re.sub(r"\b(?:typing|[a-z_]+(?:\.[a-z_]+)*)\.(?=[A-Z])", "", text)


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation names, inside unions and containers too (the
    schema's generator and scripts/summary_docs.py walk the summaries' tree with it)."""
    from typing import get_args

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in models_in(arg)]


def json_schema() -> dict[str, Any]:
    """One JSON Schema for every command's summary (a `oneOf` on `command`)."""
    from typing import Annotated, Union

    from pydantic import TypeAdapter

    union = Annotated[Union[tuple(SUMMARIES.values())], Field(discriminator="command")]  # noqa: UP007
    schema = TypeAdapter(union).json_schema(by_alias=True, mode="serialization")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"raylane summary, schema version {SCHEMA_VERSION}",
        **schema,
    }
