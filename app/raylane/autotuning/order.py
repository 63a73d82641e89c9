"""`raylane autotune`'s search order, on rank 0: which candidate next, from the outcomes so far.
Pure Python (no torch, no Ray): `raylane.autotuning.search` runs each candidate it yields."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, TypeGuard

from raylane.autotuning.ranking import beats
from raylane.loop.protocols.result import Fit, Outcome

MIN_SIZES_SCANNED = 3
# Knobs tried one at a time from the best configuration so far, after strategy and micro-batch.
KNOB_ORDER = (
    "train.precision",
    "train.activation_checkpointing",
    "train.compile",
    "strategy.bucket_cap_mb",
    "strategy.reshard_after_forward",
    "strategy.comm_hook",
)
# Runs a candidate (rank 0 yields its values to the search) unless it ran already: its outcome.
Attempt = Callable[[dict[str, Any]], Generator[dict[str, Any], Outcome, Outcome]]
DDP_ONLY = ("strategy.bucket_cap_mb", "strategy.comm_hook")
FSDP_ONLY = ("strategy.reshard_after_forward",)


def plan(space: dict[str, list[Any]], own: dict[str, Any] | None = None) -> Generator[dict[str, Any], Outcome, None]:
    """Candidates, likeliest winners first; each `send` returns the last candidate's outcome.

    Per strategy: the largest micro-batch first, then a binary search for the largest that fits
    (as DeepSpeed's autotuner does), then smaller ones while throughput still rises (at least
    MIN_SIZES_SCANNED of them: one noisy profile must not end the scan). From the
    best so far, each other knob is tried one value at a time and kept when it is clearly faster
    (its interval above the best's; within the noise, the simpler is kept: see raylane.autotuning.ranking);
    activation checkpointing also gets the micro-batch above the one that fit without it. `own`:
    the config's own values (the simplest); default, each list's first value."""
    seen: dict[tuple, Outcome] = {}
    knobs = {k: v[0] for k, v in space.items()}
    own = knobs if own is None else own

    def better(outcome: Outcome | None, values: dict[str, Any]) -> TypeGuard[Outcome]:
        return _ok(outcome) and (best is None or beats(outcome, values, best[0], best[1], own, space))

    def key(values: dict[str, Any]) -> tuple:
        return tuple(sorted(values.items()))

    def attempt(values: dict[str, Any]) -> Generator[dict[str, Any], Outcome, Outcome]:
        if key(values) not in seen:
            seen[key(values)] = yield dict(values)
        return seen[key(values)]

    best: tuple[Outcome, dict[str, Any]] | None = None
    sizes = sorted(space["train.batch_size"], reverse=True)
    for strategy in space["strategy.name"]:
        values = {**knobs, "strategy.name": strategy}
        found = yield from _largest_fitting(values, sizes, attempt)
        if found is None:
            continue
        yield from _smaller_sizes(values, sizes[found:], attempt)
        for size in sizes[found:]:
            outcome = seen.get(key({**values, "train.batch_size": size}))
            if better(outcome, {**values, "train.batch_size": size}):
                best = (outcome, {**values, "train.batch_size": size})
    if best is None:
        return
    for knob in KNOB_ORDER:
        strategy = best[1]["strategy.name"]
        if knob not in space or (knob in DDP_ONLY and strategy != "ddp") or (knob in FSDP_ONLY and strategy != "fsdp"):
            continue
        for value in space[knob]:
            trial = {**best[1], knob: value}
            if value == best[1][knob]:
                continue
            outcome = yield from attempt(trial)
            if better(outcome, trial):
                best = (outcome, trial)
            bigger = sizes.index(trial["train.batch_size"]) - 1
            if knob == "train.activation_checkpointing" and value and bigger >= 0:
                larger = {**trial, "train.batch_size": sizes[bigger]}
                outcome = yield from attempt(larger)
                if better(outcome, larger):
                    best = (outcome, larger)


def _smaller_sizes(values: dict[str, Any], sizes: list[int], attempt: Attempt) -> Generator[dict, Outcome, None]:
    """From the largest micro-batch that fits (`sizes[0]`) down, while throughput still rises
    (at least MIN_SIZES_SCANNED of them: one noisy profile must not end the scan)."""
    rate = None
    for scanned, size in enumerate(sizes, 1):
        outcome = yield from attempt({**values, "train.batch_size": size})
        speed = outcome.samples_per_s or 0.0
        if not _ok(outcome) or (rate is not None and speed <= rate and scanned >= MIN_SIZES_SCANNED):
            break
        rate = max(rate or 0.0, speed)


def _largest_fitting(
    values: dict[str, Any], sizes: list[int], attempt: Attempt
) -> Generator[dict, Outcome, int | None]:
    """Index in `sizes` (largest first) of the largest micro-batch that fits, or None."""
    if _ok((yield from attempt({**values, "train.batch_size": sizes[0]}))):
        return 0
    low, high, found = 1, len(sizes) - 1, None
    while low <= high:
        mid = (low + high) // 2
        if _ok((yield from attempt({**values, "train.batch_size": sizes[mid]}))):
            found, high = mid, mid - 1
        else:
            low = mid + 1
    return found


def _ok(outcome: Outcome | None) -> TypeGuard[Outcome]:
    return outcome is not None and outcome.status == Fit.OK
