"""Per-rank step times, stragglers and the `profile:` section, in-process (raylane.loop.observe.steptimes,
raylane.config.observe): the figures a window gives, a slow rank named once (data-bound or not), a
calm group naming none, the summary's lines. A real torch.profiler window (~4 s on its own: torch
imports its compiler's config when a profiler starts) and the figures gathered over a real group
are tests/e2e/test_observability.py's torchrun run."""

from __future__ import annotations

import pytest

from raylane.config import ConfigError, load_config
from raylane.loop.observe.steptimes import FIGURES, StepTimer, StepTimes, busy_times, split_rows, window_figures
from raylane.results import Status, TrainSummary
from raylane.tracking.observe import profile_line, rank_table_csv
from raylane.tracking.progress import outcome_text
from tests.conftest import REPO

DIGITS = REPO / "pipelines" / "digits.yaml"
NODES = ["node-a", "node-a", "node-b", "node-b"]


def row(step: float, data: float, arrive: float, steps: float = 10, optim: float = 0.001) -> tuple[float, ...]:
    """One rank's window: (steps, step, data, arrival at the sync, compute, optimizer)."""
    return (steps, step, data, arrive, step - data - optim, optim)


def data_bound_window() -> list[tuple[float, ...]]:
    # Rank 2 waits 80 ms for each batch; the others reach the gradient sync after 5 ms and wait
    # there for it: every rank's step takes 100 ms.
    return [row(0.1, 0.001, 0.005), row(0.1, 0.001, 0.005), row(0.1, 0.08, 0.085), row(0.1, 0.001, 0.006)]


def test_a_rank_late_at_the_sync_is_the_slowest_though_every_step_takes_as_long():
    rows = data_bound_window()
    busy = busy_times(rows)
    assert busy[2] == pytest.approx(0.1) and busy[0] == pytest.approx(0.02)
    f = window_figures(rows, NODES)
    m = f["metrics"]
    assert (f["slowest"], f["node"]) == (2, "node-b")
    assert m["steps/slowest_rank"] == 2 and m["steps/step_s_max"] == pytest.approx(0.1)
    assert m["steps/step_s_min"] == pytest.approx(0.02) and m["steps/step_s_median"] == pytest.approx(0.0205)
    assert m["steps/slowest_data_share"] == pytest.approx(0.8) and m["steps/data_share_median"] < 0.1
    assert m["steps/slowest_vs_others"] == pytest.approx(5.0)
    assert len(m) == 7  # the same few aggregates whatever the world size


def test_a_rank_slow_for_n_windows_running_is_named_once_with_its_node_and_data_bound():
    times = StepTimes(10, factor=1.5, windows=3, active=True)
    times.start(0, NODES)
    named = [times.window(10 * (i + 1), data_bound_window())[1] for i in range(6)]
    assert [len(n) for n in named] == [0, 0, 1, 0, 0, 0]  # the third window running, and only once
    s = named[2][0]
    assert (s.rank, s.node, s.step, s.windows, s.data_bound) == (2, "node-b", 30, 3, True)
    assert s.ratio == pytest.approx(0.1 / 0.02, rel=1e-3) and s.median_s == pytest.approx(0.02)  # the others'
    assert "rank 2 on node-b takes 5.0x the other ranks' median step" in s.line() and "(data-bound)" in s.line()
    table = {r["rank"]: r for r in times.table.rows()}
    assert table[2]["steps"] == 60 and table[2]["data_share"] == pytest.approx(0.8)
    assert rank_table_csv(times.table.rows()).splitlines()[0] == ",".join(table[0])


def test_a_slow_forward_is_named_as_its_own_compute_and_a_broken_streak_starts_again():
    slow = [row(0.1, 0.001, 0.006), row(0.1, 0.001, 0.07)]  # rank 1's forward: late at the sync, not on data
    calm = [row(0.1, 0.001, 0.006), row(0.1, 0.001, 0.007)]
    times = StepTimes(10, factor=1.5, windows=2, active=True)
    times.start(0, ["a", "b"])
    seen = [times.window(i, w)[1] for i, w in enumerate([slow, calm, slow, slow], 1)]
    assert [len(n) for n in seen] == [0, 0, 0, 1]
    assert seen[3][0].rank == 1 and not seen[3][0].data_bound and "its own compute is slow" in seen[3][0].line()


def test_a_calm_group_names_none():
    times = StepTimes(10, factor=1.5, windows=1, active=True)
    times.start(0, NODES)
    jitter = [row(0.1, 0.002 + 0.001 * r, 0.008 + 0.002 * r) for r in range(4)]
    assert all(not times.window(i, jitter)[1] for i in range(5))
    one_rank = StepTimes(10, factor=1.5, windows=1, active=True)
    one_rank.start(0, ["a"])
    assert one_rank.window(10, [row(0.1, 0.09, 0.095)])[1] == []  # alone: nobody to be slower than


def test_a_window_rides_on_the_first_vote_after_a_logging_window_ends_the_same_on_every_rank():
    times = StepTimes(10, 1.5, 3, active=False)
    times.start(5, ["a"])
    assert [s for s in range(5, 40) if times.due(s)][:1] == [10]
    times.take(13)  # the vote at step 13 carried it
    assert not times.due(19) and times.due(20)
    assert split_rows([*range(12)], 2) == [tuple(range(6)), tuple(range(6, 12))] and len(FIGURES) == 6


def test_the_timer_splits_a_step_into_its_parts(monkeypatch):
    clock = iter([0.0, 0.3, 0.4, 0.9, 1.0, 1.0, 1.0, 1.5, 1.5, 2.0])
    monkeypatch.setattr("raylane.loop.observe.steptimes.time.perf_counter", lambda: next(clock))
    timer = StepTimer()
    for _ in range(2):  # the second step's batch was ready: no data wait
        timer.begin()
        timer.fetched()
        timer.arrive()
        timer.computed()
        timer.ended()
    steps, step, data, arrive, compute, optim = timer.take()
    assert steps == 2 and step == pytest.approx(1.0) and data == pytest.approx(0.15)
    assert arrive == pytest.approx(0.45) and compute == pytest.approx(0.55) and optim == pytest.approx(0.3)
    assert timer.take()[0] == 0


def test_profile_is_off_by_default_and_one_key_turns_it_on():
    off = load_config(DIGITS)
    assert not off.profile.enabled and off.profile.ranks == [0, "slowest"] and off.stragglers.factor == 1.5
    on = load_config(DIGITS, ["profile.enabled=true"])
    assert on.profile.enabled and (on.profile.wait, on.profile.warmup, on.profile.active) == (5, 1, 3)


@pytest.mark.parametrize(
    ("override", "field", "value"),
    [
        ("profile.active=0", "profile.active", "0"),
        ("profile.activities=[tpu]", "profile.activities", "'tpu'"),
        ("profile.ranks=[]", "profile.ranks", "[]"),
        ("profile.ranks=[-1]", "profile.ranks", "-1"),
        ("stragglers.factor=1", "stragglers.factor", "1"),
    ],
)
def test_bad_profile_values_name_the_field_and_the_value(override, field, value):
    with pytest.raises(ConfigError) as info:
        load_config(DIGITS, [override])
    assert field in str(info.value) and value in str(info.value)


def test_the_summary_block_names_the_straggler_and_where_the_profile_is():
    s = TrainSummary(
        status=Status.FINISHED,
        run_name="r",
        stragglers=[
            {
                "rank": 1,
                "node": "n1",
                "step": 40,
                "ratio": 2.5,
                "step_s": 0.1,
                "median_s": 0.04,
                "data_share": 0.9,
                "data_bound": True,
                "windows": 3,
            }
        ],  # fmt: skip
        profile_traces=["/runs/r/profiles/trace-rank0-n0.json.gz", "/runs/r/profiles/trace-rank1-n1.json.gz"],
    )
    text = outcome_text(s, "mlflow ui")
    assert "  straggler:     rank 1 on n1 takes 2.5x the other ranks' median step" in text
    line = next(x for x in text.splitlines() if x.startswith("  profile:"))
    assert "2 traces in /runs/r/profiles (open a trace in https://ui.perfetto.dev" in line
    assert "top-ops-rank0-n0.md" in line and profile_line([]).startswith("none written")


def test_with_profile_off_or_on_another_rank_no_profiler_is_made():
    """What rank 0 of tests/e2e/test_observability.py's run shows in its process (profiling never
    imported, no profiler on), from the one condition every door goes through."""
    from types import SimpleNamespace

    from raylane.loop.run import _profiler

    rank0 = SimpleNamespace(rank=0, store=None, device=None)
    assert _profiler(load_config(DIGITS), rank0) is None
    assert _profiler(load_config(DIGITS, ["profile.enabled=true", "profile.ranks=[1]"]), rank0) is None


def test_the_others_median_leaves_out_the_rank_itself_at_any_size():
    import random
    import statistics

    from raylane.loop.observe.steptimes import median_without

    rng = random.Random(0)
    for n in (1, 2, 3, 4, 7, 256):
        values = sorted(rng.random() for _ in range(n))
        for at in sorted({0, n // 2 - 1, n // 2, n - 2, n - 1} & set(range(n))):
            rest = values[:at] + values[at + 1 :]
            assert median_without(values, at) == (statistics.median(rest) if rest else 0.0)


def _timed_steps(plans: list, steps: int) -> list[tuple[float, ...]]:
    """Each rank's window, in a thread of its own: its steps marked in the Trainer's order around
    the fault plan's hooks, every rank meeting at a barrier where DDP's gradient sync would be."""
    import threading
    import time

    sync = threading.Barrier(len(plans), timeout=10)
    rows: list = [None] * len(plans)

    def rank(r: int) -> None:
        timer = StepTimer()
        for step in range(1, steps + 1):
            timer.begin()
            plans[r].before_fetch(step)  # the Trainer's loop, while it waits for the step's batch
            timer.fetched()
            plans[r].before_step(step)  # with the batch in hand, before the forward
            time.sleep(0.002)  # the forward
            timer.arrive()
            sync.wait()  # the last backward's gradient all-reduce
            timer.computed()
            timer.ended()
        rows[r] = timer.take()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(plans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return rows


@pytest.mark.parametrize(("kind", "data_bound"), [("slowdata", True), ("slow", False)])
def test_a_rank_slowed_through_the_fault_plan_is_named_a_slow_loader_or_a_slow_step(kind, data_bound, monkeypatch):
    """RAYLANE_FAULTS `slowdata` sleeps in the data wait, `slow` in the step's compute: the real
    plan through the real timer names rank 1, as data-bound or as its own compute. The slow
    loader end to end under torchrun, the slow step on Ray: tests/e2e/test_observability.py."""
    from raylane.loop.observe import faults

    monkeypatch.setenv(faults.ENV, f"{kind}@rank=1,ms=20,step=2")
    plans = [faults.load(r) for r in (0, 1)]
    assert plans[0].slow == {"slow": None, "slowdata": None}  # rank 0 is not slowed
    rows = _timed_steps(plans, 4)  # rank 1 slept at steps 2 to 4
    steps, step_s, data_s, _, compute_s, _ = rows[1]
    assert steps == 4 and step_s >= 0.015 and (data_s > compute_s) == data_bound, rows[1]
    times = StepTimes(4, factor=1.5, windows=1, active=True)
    times.start(0, ["node-a", "node-b"])
    [named] = times.window(4, rows)[1]
    assert (named.rank, named.node, named.data_bound) == (1, "node-b", data_bound)


def test_an_unset_fault_plan_is_none_and_a_slow_fault_needs_its_duration(monkeypatch):
    from raylane.loop.observe import faults

    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.load(0) is None  # the Trainer's `if self.faults` skips every hook
    with pytest.raises(ValueError, match="slow@rank=1,ms=60"):
        faults.parse("slow@rank=1")


def test_step_timing_off_reads_no_clock_and_gathers_nothing(monkeypatch):
    """stragglers.enabled: false: the Trainer's marks do nothing, no window is due (no figures on
    the vote), rank 0 has nothing to log or name."""
    monkeypatch.setattr("raylane.loop.observe.steptimes.time.perf_counter", lambda: pytest.fail("the clock was read"))
    times = StepTimes(10, 1.5, 3, active=True, enabled=False)
    for mark in ("begin", "fetched", "arrive", "computed", "ended"):
        getattr(times.timer, mark)()
    assert not any(times.due(s) for s in range(100)) and times.window(20, data_bound_window()) == ({}, [])
    assert (
        load_config(DIGITS).stragglers.enabled
        and not load_config(DIGITS, ["stragglers.enabled=false"]).stragglers.enabled
    )
