"""The driver's paths at many simulated ranks (issue 63; bench B15 measures them at 2, 256 and
1,024): what they record, send and wait for is bounded, or grows no faster than the ranks. Each
path is fed what N ranks send, shaped as the real types are (scripts/benchmarks/driverpaths.py,
the benchmark's own simulation); the collectives' bytes on torch's `fake` process group. Work
is counted (lines executed, bytes, entries, the seconds a wait asks for on a virtual clock),
never timed: speed targets live in the benchmark only."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest

from raylane.loop.observe import hangs
from raylane.loop.observe.steptimes import StepTimes
from raylane.loop.reporting import MAX_STRAGGLERS_NAMED, Reporter
from scripts.benchmarks import driverpaths as paths


def test_a_windows_mlflow_entries_are_as_many_at_1024_ranks_as_at_256():
    """Rank 0's window (its train metrics and the step times' aggregates) and the driver's
    health interval (128 nodes of 8 GPUs at 1,024 ranks). Failed before the health's figures over
    the nodes: 1,504 entries an interval at 256 ranks, 6,016 at 1,024 (a series per node and GPU)."""
    at = {n: paths.step_times(n, windows=6, memory=False) for n in (256, 1024)}
    assert at[256]["mlflow_per_window"] == at[1024]["mlflow_per_window"] == {"metrics": 7, "tags": 0}
    health = {n: paths.mlflow(n, windows=3) for n in (2, 256, 1024)}
    assert health[256]["train_metrics_per_window"] == health[1024]["train_metrics_per_window"] == 6
    assert health[256]["health_metrics_per_interval"] == health[1024]["health_metrics_per_interval"] <= 40
    assert (
        health[2]["health_metrics_per_interval"] == 47
    )  # a small run keeps each node's series (1 node: 7 fields, 8 GPUs x 5)


def _stragglers_recorded(n: int) -> tuple[int, int]:
    """(MLflow tags, driver events) over a run whose slowest 1/16 of ranks (a rack) are named."""
    events: list[object] = []
    entries = paths.Entries()
    times = StepTimes(
        10, 1.5, 3, active=True, sink=Reporter(is_rank_zero=True, publish=events.append, metric_logger=entries)
    )
    times.start(0, [f"node{r // paths.PER_NODE}" for r in range(n)])
    rows = paths.step_rows(n, random.Random(0), range(0, n, 16))
    tags = 0
    for w in range(6):
        times.gathered(10 * (w + 1), rows, n)
        tags += entries.take()["tags"]
    assert len(times.stragglers()) == n // 16  # the summary still has every one
    return tags, len(events)


def test_stragglers_named_in_mlflow_and_on_the_terminal_are_bounded():
    """Failed before the cap: 16 tags and events at 256 ranks, 64 at 1,024 (one per slow rank)."""
    tags, events = _stragglers_recorded(1024)
    assert (tags, events) == _stragglers_recorded(256)
    assert events == MAX_STRAGGLERS_NAMED + 1  # the named ones, and one line that says there are more
    assert tags == MAX_STRAGGLERS_NAMED  # the others are counted in one tag at the run's end


def test_the_straggler_detectors_work_grows_linearly_with_the_ranks():
    """Lines executed on rank 0 per window: 9,294 at 256 ranks, 36,942 at 1,024 (3.97x)."""
    at = {n: paths.step_times(n, windows=4, memory=False)["lines"] for n in (256, 1024)}
    assert at[1024] / at[256] <= 4.5, at
    assert paths.step_times(256, windows=30)["memory_growth_bytes"] < 64_000  # not per window


def test_a_hang_diagnosis_waits_within_its_bound_whatever_the_ranks():
    """The wait for the stacks on a virtual clock. Failed before (a 50 ms sleep per peer's
    dump read): 12.75 s at 256 ranks against a bound of 3 s (51 s at 1,024)."""
    run = paths.one_hang(256)
    assert run["rank_waited_s"] <= hangs.ANSWER_WAIT_S
    assert "rank 131 on node16 at /work/pipelines/mine.py:42 in forward" in run["line"] and run["same_line"]


def test_a_hangs_stack_files_grow_linearly_not_with_the_ranks_squared():
    """Every timed-out rank wrote every peer's stacks before: 64 x 63 = 4,032 files at 64 ranks
    into the shared folder (1,047,552 at 1,024); now the first collects, the others write their own."""
    run = paths.one_hang(64)
    assert run["run_files_written"] <= 2 * 64 and run["same_line"]


def test_a_rank_that_does_not_collect_waits_for_the_line_within_its_bound(tmp_path, monkeypatch):
    """The collector never writes its line (killed): the other rank's wait ends at LINE_WAIT_S
    and its line names who collects."""
    clock = paths.VirtualClock()
    monkeypatch.setattr(hangs, "time", clock)
    watch = hangs.HangWatch(str(tmp_path), 5, 8, 60.0)
    watch.start()
    try:
        (tmp_path / hangs.STACKS).mkdir()
        (tmp_path / hangs.RANKS / hangs.COLLECTOR).write_text("3")
        error = watch.diagnose(RuntimeError("Timed out waiting 60000ms for recv"))
    finally:
        watch.close()
    assert clock.waited <= hangs.LINE_WAIT_S + hangs.POLL_S
    assert "rank 3 collects every rank's stack" in str(error)


def test_the_hang_line_names_ranks_as_ranges_and_does_not_grow_with_them():
    """1,023 silent peers and a node of 8 stuck at one place. Failed before: 5,000 characters
    ('no stack from rank 1, 2, 3, ...'), a '; rank R at' part per stuck rank."""
    entry = lambda r: hangs.RankEntry(r, 100 + r, "h", 1, "/runs/x", "h")  # noqa: E731
    stuck = {r: paths.dump(r, stuck=True).replace(f"0x{1000 + r:016x}", "0x1") for r in range(8, 16)}
    line = hangs.hang_line(60, [entry(r) for r in range(1, 1024)], stuck, 1023, "/runs/x/stacks")
    assert "never reached it: ranks 8-15 on h at /work/pipelines/mine.py:42 in forward;" in line
    assert "no stack from ranks 1-7, 16-1023 (not on this host, or gone)" in line and len(line) < 300


def test_a_commits_bytes_on_rank_0_grow_with_the_ranks_parts_only():
    """Rank 0's bytes in a sharded save's commit, and in an upload's agreement, on the fake group.
    Failed before (an all-gather of 32 KB buffers on every rank): 8.4 MB at 256 ranks each."""
    at = {n: paths.commit(n) for n in (256, 1024)}
    assert at[256]["agree_bytes"] == at[1024]["agree_bytes"] == 16  # one all-reduce of two numbers
    assert at[1024]["commit_bytes"] <= 1024 * 400  # each rank's part (~300 bytes), not 32 KB
    assert paths.preemption(1024)["vote_bytes"] == paths.preemption(2)["vote_bytes"] == 40


SIDE_GROUP_WAIT = textwrap.dedent("""
    import datetime, sys, time, types
    import torch.distributed as dist
    from raylane.loop.distributed.groups import ControlVote
    from raylane.loop.run import _side_groups

    rank, init = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=3))
    cfg = types.SimpleNamespace(
        scaling=types.SimpleNamespace(use_gpu=True), checkpoint=types.SimpleNamespace(async_save=True),
        dist=types.SimpleNamespace(timeout_s=3.0),
    )
    control, saves = _side_groups(cfg, 2)
    if rank == 1:
        time.sleep(40)  # never votes
    else:
        started = time.monotonic()
        try:
            ControlVote(1, control).poll(True)
        except Exception as exc:
            print(f"{time.monotonic() - started:.1f}", type(exc).__name__, flush=True)
    import os
    os._exit(0)
""")


def test_the_votes_group_waits_for_a_missing_rank_no_longer_than_dist_timeout_s(tmp_path):
    """A GPU run's step-boundary vote runs on a gloo group of its own (and an async save's commit
    on another): a rank that never comes ends it at dist.timeout_s. Failed before: the groups had
    torch's default, 30 minutes: the vote waited until rank 1 exited, 40 s later)."""
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen([sys.executable, "-c", SIDE_GROUP_WAIT, str(r), init], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    try:
        out, _ = procs[0].communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0's vote still waited for rank 1 after 60 s")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    seconds, kind = out.split()
    assert float(seconds) < 30 and kind in ("RuntimeError", "DistBackendError"), out


def test_b15s_table_fits_each_figures_growth_from_256_to_1024_ranks():
    from scripts.benchmarks.driverscale import exponent, rows

    assert exponent(256, 1024) == pytest.approx(1.0) and exponent(16, 16) == 0.0 and exponent(0, 5) is None
    table = [
        {
            "path": "hang",
            "figure": "stack files written, the whole run",
            "values": [2, 65_280, 1_047_552],
            "exponent": 2.0,
        },
        {"path": "MLflow", "figure": "health metrics per interval", "values": [47, 37, 37], "exponent": 0.0},
    ]
    [quadratic, flat] = rows({"ranks": [2, 256, 1024], "table": table})
    assert quadratic[2] == "2 / 65,280 / 1,047,552 (n^2.00)" and quadratic[4] == "**no**"
    assert flat[2] == "47 / 37 / 37 (flat)" and flat[4] == "yes"
