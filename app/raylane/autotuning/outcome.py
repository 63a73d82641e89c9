"""What one `raylane autotune` candidate measured: `Outcome`, and the `Fit` it ended with. Pure
Python (no torch, no Ray): built on the ranks, read by the search order, the ranking and the
driver's report. It crosses processes as `to_dict()` (the search's record, and the `Candidate`,
`Round` and `End` events): the record's lines and the events keep the keys they had as dicts."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any


class Fit(StrEnum):
    """How a candidate (or one of its rounds) ended. The value is what the summary, the table and
    the child run's `raylane.autotune.status` tag show."""

    OK = "ok"  # measured
    OOM = "oom"  # out of memory on some rank (agreed by all)
    FAILED = "failed"  # another error, or its worker group died while profiling it
    PRUNED = "pruned"  # rank 0's memory estimate said it would not fit: never run


@dataclass(frozen=True, slots=True)
class Outcome:
    """A candidate's figures: its first round, or its rounds merged (raylane.autotuning.ranking).
    None: not measured (a candidate that did not run, or a figure this pipeline has none of)."""

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
        """The JSON form: `status` as its value, flags only when set."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["status"] = self.status.value
        for flag in ("replayed", "final"):
            if not out[flag]:
                del out[flag]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outcome:
        """Back from to_dict() (or a record an earlier launch wrote); a key it does not know is left out."""
        known = {f.name for f in fields(cls)}
        kept = {k: v for k, v in data.items() if k in known}
        return cls(**{"values": {}, **kept, "status": Fit(data.get("status", Fit.OK))})
