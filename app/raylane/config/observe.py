"""The sections that look inside a run: `profile` (torch.profiler traces of a window of steps, on
chosen ranks; off by default) and `stragglers` (when a rank's step times name it as slow). Apart
because step times are measured on every run, profile or not: a `profile.*` key that acts while
`profile.enabled` is false would read wrong. Nothing here imports torch or Ray."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from raylane.config.section import Section


class ProfileSection(Section):
    """A torch.profiler trace of a window of steps (docs/observability.md)."""

    enabled: bool = Field(
        False,
        description="Profile a window of steps on `ranks`: a gzipped Chrome trace per rank and a table of the top "
        "operations by self time in `<storage_path>/<run.name>/profiles/`, and in MLflow under `profiles/`. "
        "false: torch.profiler is neither started nor set up, and nothing is paid.",
    )
    ranks: list[int | Literal["slowest"]] = Field(
        [0, "slowest"],
        min_length=1,
        max_length=64,
        description="The ranks profiled (a rank the group does not have is not profiled), and `slowest`: the rank "
        "the step times name as a straggler (stragglers.*) profiles one window (`active` steps, after 1 of warmup) "
        "from its next step, unless listed already; with stragglers.enabled false, or a calm run, none is.",
    )
    wait: int = Field(5, ge=0, le=1_000_000, description="Steps skipped before the window (torch.profiler.schedule).")
    warmup: int = Field(
        1, ge=0, le=1000, description="Steps traced but thrown away before the active ones (the tracer's start-up)."
    )
    active: int = Field(3, ge=1, le=1000, description="Steps recorded in the trace.")
    repeat: int = Field(
        1, ge=0, le=1000, description="Windows of wait + warmup + active steps, one trace each; 0: until the end."
    )
    activities: list[Literal["cpu", "cuda"]] = Field(
        ["cpu", "cuda"],
        min_length=1,
        description="What is traced: the CPU's operators, and the GPU's kernels (`cuda`, on a rank with a GPU only).",
    )
    record_shapes: bool = Field(False, description="Record each operator's input shapes.")
    profile_memory: bool = Field(False, description="Record the memory each operator allocates and frees.")
    with_stack: bool = Field(False, description="Record the Python stack of each operator (larger traces).")
    top_ops: int = Field(25, ge=1, le=1000, description="Rows of the top-operations table, by self time.")
    memory_snapshot_step: int | None = Field(
        None,
        ge=1,
        le=100_000_000,
        description="On each profiled rank with a GPU: after this step (the run's count, as the logs give it) a "
        "CUDA memory snapshot, `profiles/memory-rank<R>-<node>-step<S>.pickle` (open it in "
        "https://pytorch.org/memory_viz): every live allocation, with its stack. null: none. Without a GPU: one "
        "warning, nothing else.",
    )
    memory_snapshot_on_oom: bool = Field(
        False,
        description="On each profiled rank with a GPU: when it runs out of memory (torch.OutOfMemoryError), a "
        "snapshot `profiles/memory-rank<R>-<node>-oom.pickle` before the error ends the run as it would anyway.",
    )
    memory_history_entries: int = Field(
        100_000,
        ge=1000,
        le=10_000_000,
        description="The allocation events a memory snapshot's timeline keeps, the last ones (max_entries of "
        "torch.cuda.memory._record_memory_history); recorded from the first step on a rank that takes a snapshot.",
    )

    @field_validator("ranks")
    @classmethod
    def _ranks(cls, value: list[int | str]) -> list[int | str]:
        if any(isinstance(r, int) and r < 0 for r in value):
            raise ValueError(f"profile.ranks = {value}: a rank is 0 or more")
        return value


class StragglersSection(Section):
    """When a rank is named as a straggler: every rank times its steps (data wait, forward and
    backward, optimizer, the whole step), and rank 0 compares them every logging window."""

    enabled: bool = Field(
        True,
        description="Time every rank's steps and name stragglers. false: no step is timed, no figure rides on the "
        "step-boundary vote, and MLflow gets no `steps/*` metrics nor the per-rank table (docs/benchmarks.md B13: "
        "its cost).",
    )
    factor: float = Field(
        1.5,
        gt=1,
        le=1000,
        description="A rank whose step time (less what it waited for the others at the gradient sync) is this many "
        "times the other ranks' median is slow.",
    )
    windows: int = Field(
        3,
        ge=1,
        le=10_000,
        description="Windows running a rank must be slow in before it is named as a straggler (once).",
    )
