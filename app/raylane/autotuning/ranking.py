"""`raylane autotune`'s verdict from repeated measurements: an interval per candidate, the
leader, the candidates tied with it, the simplest of those, and which candidates to measure
again. Pure Python (no torch, no Ray), used on rank 0 by the search and on the driver.

A candidate is measured in rounds (a fresh build each time, at a different moment: a busy machine
slows a whole round at once), each round in windows of steps. Its figure is the median samples/s
of all its windows: on a machine shared with other work a window can stall for seconds, and
samples over seconds would let one stall decide (two searches of examples/own-model under load,
by that figure, disagreed: one put the config's own values, measured in three loaded rounds,
clearly behind). Its interval is a 90% two-stage bootstrap interval of that median: rounds drawn
with replacement, then windows within each, so that the spread between rounds (the machine's
load from one moment to the next) widens it as much as the spread within a round. Two candidates
whose intervals overlap differ by less than the noise: a tie."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from raylane.loop.protocols.result import Outcome

CONFIDENCE = 0.9
BOOTSTRAP_DRAWS = 2000
# Which knob decides between tied candidates that depart from the config equally often: the
# first in this order whose value differs (most of a training setup's behaviour first).
SIMPLICITY_ORDER = (
    "train.compile",
    "train.activation_checkpointing",
    "train.precision",
    "strategy.name",
    "train.batch_size",
    "strategy.comm_hook",
    "strategy.reshard_after_forward",
    "strategy.bucket_cap_mb",
)

Rounds = Sequence[Sequence[float]]


@dataclass(frozen=True, slots=True)
class Ranking:
    """The verdict over a search's candidates, as indices into them."""

    leader: int  # the highest median
    ties: list[int]  # whose interval overlaps the leader's (the leader among them), simplest first
    winner: int  # the simplest of the ties

    @property
    def clear(self) -> bool:
        """No other candidate is within the noise of the winner."""
        return len(self.ties) == 1


def median_interval(rates: Rounds) -> tuple[float, float, float]:
    """(median, low, high) of the windows' samples/s, `rates` holding each round's windows."""
    rounds = [list(r) for r in rates if r]
    if not rounds:
        raise ValueError("no windows measured")
    mid = statistics.median(x for r in rounds for x in r)
    draw = random.Random(0)  # the same measurements give the same interval
    stats = []
    for _ in range(BOOTSTRAP_DRAWS):
        picked: list[float] = []
        for _ in rounds:
            windows = rounds[draw.randrange(len(rounds))]
            picked.extend(windows[draw.randrange(len(windows))] for _ in windows)
        stats.append(statistics.median(picked))
    stats.sort()
    tail = (1 - CONFIDENCE) / 2
    low, high = stats[int(tail * len(stats))], stats[min(int((1 - tail) * len(stats)), len(stats) - 1)]
    return mid, min(low, mid), max(high, mid)


def summarize(outcome: Outcome, rates: Rounds, seconds: Rounds) -> Outcome:
    """`outcome` with the figures of windows measured in rounds: samples/s, and the seconds each lasted."""
    mid, low, high = median_interval(rates)
    return replace(
        outcome,
        samples_per_s=mid,
        interval=[low, high],
        windows=[list(r) for r in rates],
        window_s=[list(t) for t in seconds],
    )


def ok(outcome: Outcome | None) -> bool:
    return outcome is not None and outcome.ok


def speed(outcome: Outcome) -> float:
    """Its samples/s, 0 when it has none (never ranked: see ok)."""
    return outcome.samples_per_s or 0.0


def rounds(outcome: Outcome) -> int:
    return outcome.rounds or 1


def interval(outcome: Outcome) -> tuple[float, float]:
    """An outcome without windows (one figure) is its own interval."""
    low, high = outcome.interval or (speed(outcome), speed(outcome))
    return low, high


def clearly_faster(a: Outcome, b: Outcome) -> bool:
    return interval(a)[0] > interval(b)[1]


def overlaps(a: Outcome, b: Outcome) -> bool:
    return not clearly_faster(a, b) and not clearly_faster(b, a)


def simplicity(values: dict[str, Any], own: dict[str, Any], space: dict[str, list[Any]]) -> tuple:
    """Smaller is simpler: first how many knobs depart from the config's own values, then, knob
    by knob in SIMPLICITY_ORDER, the value's place: the config's own value, then the order of
    its list in the space (raylane's defaults list the plain value first: fp32, no compile, no
    recompute, the config's bucket size...); for the micro-batch, larger first (fewer
    accumulation steps)."""
    ranks = []
    for key in [*SIMPLICITY_ORDER, *sorted(set(values) - set(SIMPLICITY_ORDER))]:
        if key not in values:
            continue
        value = values[key]
        if key in own and value == own[key]:
            ranks.append(0)
            continue
        choices = list(space.get(key, []))
        if key == "train.batch_size":
            choices = sorted(choices, reverse=True)
        ranks.append(1 + (choices.index(value) if value in choices else len(choices)))
    return (sum(r > 0 for r in ranks), tuple(ranks))


def verdict(outcomes: Sequence[Outcome], own: dict[str, Any], space: dict[str, list[Any]]) -> Ranking | None:
    """The leader, the candidates tied with it and the winner among them; None when no candidate ran."""
    measured = [i for i, o in enumerate(outcomes) if ok(o)]
    if not measured:
        return None
    lead = max(measured, key=lambda i: (speed(outcomes[i]), -i))
    ties = sorted(
        (i for i in measured if i == lead or overlaps(outcomes[i], outcomes[lead])),
        key=lambda i: (simplicity(outcomes[i].values, own, space), i),
    )
    return Ranking(leader=lead, ties=ties, winner=ties[0])


def beats(
    a: Outcome,
    a_values: dict[str, Any],
    b: Outcome,
    b_values: dict[str, Any],
    own: dict[str, Any],
    space: dict[str, list[Any]],
) -> bool:
    """Whether `a` should replace `b` as the best so far: clearly faster, or tied and simpler."""
    if not ok(a):
        return False
    if not ok(b) or clearly_faster(a, b):
        return True
    return not clearly_faster(b, a) and simplicity(a_values, own, space) < simplicity(b_values, own, space)


def next_round(
    outcomes: Sequence[Outcome], own: dict[str, Any], space: dict[str, list[Any]], *, min_rounds: int, max_rounds: int
) -> list[int]:
    """The candidates to measure once more, the leader first (measured next to each other, a
    busy spell of the machine slows them alike); empty once the ranking is clear or the cap is
    reached. Wanted: a candidate whose interval overlaps the leader's; a candidate simpler than
    the leader measured in fewer than `min_rounds` rounds (its loss to the leader is confirmed
    on a second measurement, so one busy spell cannot decide it); and the leader itself, with
    any of those or while it has fewer than `min_rounds`."""
    found = verdict(outcomes, own, space)
    if found is None:
        return []
    lead = found.leader

    def more(i: int) -> bool:  # may be measured again
        return rounds(outcomes[i]) < max_rounds and not outcomes[i].final

    lead_key = simplicity(outcomes[lead].values, own, space)
    wanted = [
        i
        for i, o in enumerate(outcomes)
        if i != lead
        and ok(o)
        and more(i)
        and (overlaps(o, outcomes[lead]) or (rounds(o) < min_rounds and simplicity(o.values, own, space) < lead_key))
    ]
    if more(lead) and (wanted or rounds(outcomes[lead]) < min_rounds):
        wanted.insert(0, lead)
    return wanted


def merge(outcome: Outcome, again: Outcome) -> Outcome:
    """A candidate's outcome after one more round `again`: the windows pooled, the figures
    recomputed. A round that did not run (out of memory, an error) leaves the measurement as it
    was and ends the candidate's rounds."""
    if not ok(again) or not again.windows:
        return replace(outcome, final=True, round_error=again.error or again.status.value)
    merged = summarize(
        replace(
            outcome,
            rounds=rounds(outcome) + 1,
            profile_s=(outcome.profile_s or 0) + (again.profile_s or 0),
            peak_memory_bytes=max(outcome.peak_memory_bytes or 0, again.peak_memory_bytes or 0),
        ),
        [*(outcome.windows or []), *again.windows],
        [*(outcome.window_s or []), *(again.window_s or [])],
    )
    scale = speed(merged) / outcome.samples_per_s if outcome.samples_per_s else None
    if scale is not None:  # proportional to samples/s
        merged = replace(
            merged,
            tokens_per_s=None if outcome.tokens_per_s is None else outcome.tokens_per_s * scale,
            mfu=None if outcome.mfu is None else outcome.mfu * scale,
        )
    if merged.samples_per_step:
        merged = replace(merged, step_time_s=merged.samples_per_step / speed(merged))
    return merged
