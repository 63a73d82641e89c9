"""What one `raylane autotune` search is given: `SearchSettings`. Pure Python (no torch, no Ray).

The driver builds it as a dict (`settings()`, from the config's `autotune:` section) and hands
that dict to the worker group; the search reads it here, once, at its entry (`run_search`), and
the driver's Recorder at the end."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from raylane.config.batching import GlobalBatch


@dataclass(frozen=True, slots=True)
class SearchSettings:
    """The space searched, the budget, and how each candidate is measured (the defaults: a
    dict that leaves a key out gets these)."""

    space: dict[str, list[Any]]  # dotted key -> the values to try, the config's own first
    global_batch: GlobalBatch  # held by every candidate
    warmup_steps: int
    profile_steps: int  # timed per round, in `windows` windows
    max_candidates: int
    own: dict[str, Any] | None = None  # the config's own value of each key (the simplest)
    windows: int = 1
    min_window_s: float = 0.0
    min_rounds: int = 1
    max_rounds: int = 1
    budget_s: float | None = None
    safety_margin: float = 0.1  # added to a memory estimate before it prunes
    record: str | None = None  # the search's record (a relaunch replays it); None: not kept

    @classmethod
    def of(cls, given: SearchSettings | Mapping[str, Any]) -> SearchSettings:
        """`given` as SearchSettings: the driver's dict (autotune's settings()), or these already."""
        if isinstance(given, SearchSettings):
            return given
        known = {f.name for f in fields(cls)}
        kept = {k: v for k, v in given.items() if k in known and v is not None}
        held = kept["global_batch"]
        return cls(**{**kept, "global_batch": held if isinstance(held, GlobalBatch) else GlobalBatch(**held)})
