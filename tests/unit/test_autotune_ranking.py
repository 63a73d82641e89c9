"""`raylane autotune`'s verdict from measurement windows (raylane.autotuning.ranking): an
interval per candidate, ties within the noise won by the simplest candidate, more rounds while
the ranking is unclear. Pure Python: no Ray, no torch, no timing."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from raylane.autotuning.order import plan
from raylane.autotuning.ranking import (
    Ranking,
    median_interval,
    merge,
    next_round,
    simplicity,
    summarize,
    verdict,
)
from raylane.loop.protocols.result import Fit, Outcome

SPACE = {
    "strategy.name": ["ddp", "fsdp"],
    "train.batch_size": [32, 1, 2, 4, 8, 16],
    "train.precision": ["fp32", "bf16"],
    "train.activation_checkpointing": [False, True],
    "train.compile": [False],
    "strategy.bucket_cap_mb": [25.0, 5.0, 100.0],
}
OWN = {k: v[0] for k, v in SPACE.items()}


def one_round(rates: list[float]) -> Outcome:
    """A round of windows of 0.1 s each."""
    return summarize(Outcome({}), [rates], [[0.1] * len(rates)])


def candidate(windows: list[float], rounds: int = 1, **values) -> Outcome:
    return replace(one_round(windows), values={**OWN, **values}, rounds=rounds)


def test_a_stalled_window_does_not_decide_the_figure():
    """One window stalled by other work (5 s for what takes 0.1 s) leaves the median where the
    other windows put it; samples over seconds would drop it to a fifth."""
    mid, low, high = median_interval([[1000, 1010, 20, 990, 1005]])
    assert mid == 1000 and low <= 1000 <= high
    assert median_interval([[1000, 1010, 20, 990, 1005]]) == (mid, low, high)  # reproducible


def test_rounds_that_disagree_widen_the_interval_more_than_their_windows_do():
    steady = median_interval([[100, 101, 99, 100, 100], [100, 99, 101, 100, 100]])
    moved = median_interval([[100, 101, 99, 100, 100], [150, 149, 151, 150, 150]])
    assert steady[2] - steady[1] <= 2
    assert moved[1] <= 101 and moved[2] >= 149  # either round alone may stand for the candidate


@given(st.lists(st.lists(st.floats(1, 1e6), min_size=1, max_size=8), min_size=1, max_size=4))
@settings(max_examples=50, deadline=None)
def test_the_interval_holds_the_median_within_the_windows(rounds):
    mid, low, high = median_interval(rounds)
    flat = [x for r in rounds for x in r]
    assert min(flat) <= low <= mid <= high <= max(flat)


def test_overlapping_intervals_are_a_tie_won_by_the_simplest():
    """The issue's case: two candidates that differ only in DDP's bucket size, one measured a
    little faster. Their intervals overlap: a tie, and the config's own bucket size wins."""
    own = candidate([100, 120, 110, 90, 105])
    small_buckets = candidate([108, 125, 115, 95, 112], **{"strategy.bucket_cap_mb": 5.0})
    found = verdict([own, small_buckets], OWN, SPACE)
    assert found == Ranking(leader=1, ties=[0, 1], winner=0) and not found.clear
    assert verdict([small_buckets, own], OWN, SPACE) == Ranking(leader=0, ties=[1, 0], winner=1)


def test_a_clearly_faster_candidate_wins_however_complex():
    own = candidate([100, 120, 110, 90, 105])
    mixed = candidate([200, 210, 190, 205, 199], **{"train.precision": "bf16", "strategy.bucket_cap_mb": 5.0})
    assert verdict([own, mixed], OWN, SPACE) == Ranking(leader=1, ties=[1], winner=1)


def test_overlap_asks_for_more_rounds_of_the_leader_and_the_tied_until_the_cap():
    own = candidate([100, 120, 110, 90, 105], rounds=2)
    other = candidate([108, 125, 115, 95, 112], rounds=2, **{"strategy.bucket_cap_mb": 5.0})
    slow = candidate([10, 12, 11, 9, 10], rounds=1, **{"strategy.name": "fsdp"})
    assert next_round([own, other, slow], OWN, SPACE, min_rounds=2, max_rounds=4) == [1, 0]
    capped = [replace(own, rounds=4), replace(other, rounds=4), slow]
    assert next_round(capped, OWN, SPACE, min_rounds=2, max_rounds=4) == []
    assert verdict(capped, OWN, SPACE).winner == 0  # still tied at the cap: the simplest


def test_a_simpler_candidate_beaten_on_one_round_is_measured_again_with_the_leader():
    """One busy spell during the config's own round must not decide against it: its loss to a
    less simple leader is confirmed on a second round, measured next to the leader's."""
    own = candidate([50, 52, 51, 49, 50])
    lead = candidate([100, 104, 98, 101, 99], **{"strategy.bucket_cap_mb": 100.0})
    less_simple = candidate([40, 41, 42, 39, 40], **{"train.precision": "bf16"})
    assert next_round([own, lead, less_simple], OWN, SPACE, min_rounds=2, max_rounds=4) == [1, 0]
    again = merge(own, one_round([101, 99, 103, 100, 98]))  # the busy spell is gone
    assert again.rounds == 2 and [len(w) for w in again.windows] == [5, 5]
    assert verdict([again, merge(lead, one_round([100, 103, 97, 99, 102])), less_simple], OWN, SPACE).winner == 0


def test_a_clear_leader_is_measured_until_min_rounds_and_then_no_more():
    lead = candidate([100, 104, 98, 101, 99])
    slow = candidate([40, 41, 42, 39, 40], **{"train.precision": "bf16"})
    assert next_round([lead, slow], OWN, SPACE, min_rounds=2, max_rounds=4) == [0]
    assert next_round([replace(lead, rounds=2), slow], OWN, SPACE, min_rounds=2, max_rounds=4) == []


def test_a_round_that_fails_keeps_the_measurement_and_ends_the_rounds():
    own = candidate([100, 120, 110, 90, 105])
    failed = merge(own, Outcome({}, Fit.OOM, error="out of memory on rank 1"))
    assert failed.samples_per_s == own.samples_per_s and failed.final
    assert failed.round_error == "out of memory on rank 1"
    other = candidate([108, 125, 115, 95, 112], **{"strategy.bucket_cap_mb": 5.0})
    assert next_round([failed, other], OWN, SPACE, min_rounds=2, max_rounds=4) == [1]


def test_simplicity_departs_least_from_the_config_then_by_knob():
    def key(**v):
        return simplicity({**OWN, **v}, OWN, SPACE)

    assert key() < key(**{"strategy.bucket_cap_mb": 5.0}) < key(**{"strategy.bucket_cap_mb": 100.0})
    assert key(**{"train.batch_size": 16}) < key(**{"train.batch_size": 8})  # fewer accumulation steps
    assert key(**{"strategy.bucket_cap_mb": 5.0}) < key(**{"train.precision": "bf16"})
    assert key(**{"train.precision": "bf16"}) < key(**{"train.activation_checkpointing": True})
    # Two departures are less simple than one, whichever knobs.
    assert key(**{"train.activation_checkpointing": True}) < key(
        **{"strategy.bucket_cap_mb": 5.0, "train.batch_size": 16}
    )
    # The config's own value is the simplest, whatever raylane's default.
    mixed_own = {**OWN, "train.precision": "bf16"}
    assert simplicity(mixed_own, mixed_own, SPACE) < simplicity(OWN, mixed_own, SPACE)


windows = st.lists(st.floats(1, 1000, allow_nan=False), min_size=2, max_size=8)


@settings(max_examples=15, deadline=None)  # each example bootstraps intervals: ~0.1 s
@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(SPACE["strategy.bucket_cap_mb"])), st.sampled_from(SPACE["train.precision"]), windows
        ),
        min_size=1,
        max_size=5,
    ),
    st.data(),
    st.integers(1, 3),
    st.integers(0, 2),
)
def test_rounds_end_and_the_winner_is_the_simplest_of_those_tied_with_the_leader(first, data, min_rounds, extra):
    max_rounds = min_rounds + extra
    outcomes = [candidate(w, **{"strategy.bucket_cap_mb": b, "train.precision": p}) for b, p, w in first]
    measured = 0
    while wanted := next_round(outcomes, OWN, SPACE, min_rounds=min_rounds, max_rounds=max_rounds):
        assert len(set(wanted)) == len(wanted)
        for i in wanted:
            outcomes[i] = merge(outcomes[i], one_round(data.draw(windows)))
            measured += 1
        assert measured <= len(outcomes) * max_rounds
    found = verdict(outcomes, OWN, SPACE)
    lead = outcomes[found.leader]
    assert lead.samples_per_s == max(o.samples_per_s for o in outcomes)
    assert found.leader in found.ties and found.winner in found.ties
    for i, o in enumerate(outcomes):  # a tie is an overlap with the leader's interval
        apart = o.interval[1] < lead.interval[0]
        assert (i in found.ties) == (not apart)
        assert o.rounds <= max_rounds
    keys = [simplicity(outcomes[i].values, OWN, SPACE) for i in found.ties]
    assert keys == sorted(keys) and found.winner == found.ties[0]  # simplest first


def test_the_search_order_keeps_the_simpler_value_within_the_noise():
    """A knob value measured a little faster but within the noise is not kept: the next knobs
    are tried from the config's own value."""
    space = {
        "strategy.name": ["ddp"],
        "train.batch_size": [16],
        "train.precision": ["fp32"],
        "train.activation_checkpointing": [False],
        "strategy.bucket_cap_mb": [25.0, 5.0],
        "strategy.comm_hook": ["none", "bf16"],
    }
    noise = {25.0: [100, 120, 110, 90, 105], 5.0: [108, 125, 115, 95, 112]}
    search, outcome, tried = plan(space), None, []
    while True:
        try:
            values = search.send(outcome) if outcome else next(search)
        except StopIteration:
            break
        tried.append(values)
        rate = noise[values["strategy.bucket_cap_mb"]]
        outcome = one_round(rate if values["strategy.comm_hook"] == "none" else [50] * 5)
    assert [(v["strategy.bucket_cap_mb"], v["strategy.comm_hook"]) for v in tried] == [
        (25.0, "none"),
        (5.0, "none"),
        (25.0, "bf16"),
    ]
