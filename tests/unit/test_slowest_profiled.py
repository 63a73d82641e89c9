"""profile.ranks' `slowest`: the rank the step times name as the straggler profiles one window from
its next step, decided on that rank from the figures the step-boundary vote's all-reduce hands
every rank (each rank fills its own slot of a zeroed block and the sum is exact, so every rank
holds the same bits and names the same rank): no rank tells another, no collective is added.

In-process, three ranks' observers side by side, made as raylane.loop.run makes them, each fed the
same gathered figures as the vote gives them (raylane.loop.distributed.groups.ControlVote.poll's
per-rank block), through the step times' own `gathered` and a real torch.profiler window on the
rank named. The vote itself over a real group: tests/e2e/test_observability.py."""

from __future__ import annotations

import gzip
import json
import socket
from types import SimpleNamespace

import torch

from raylane.config import load_config
from raylane.loop.checkpoint.storage import CheckpointStore
from raylane.loop.run import _profiler, _slowest_profiler, _step_times
from raylane.results import TrainSummary
from raylane.tracking.progress import outcome_text
from tests.conftest import REPO

DIGITS = REPO / "pipelines" / "digits.yaml"
EVERY = 4


def gathered() -> list[float]:
    """One window as every rank holds it after the vote: (steps, step, data, arrival at the sync,
    compute, optimizer) per rank; rank 1 reaches the gradient sync 60 ms after the others (its
    busy step 0.1 s, theirs 0.04 s: 2.5x)."""
    rows = [(4, 0.1, 0.001, 0.03, 0.09, 0.009), (4, 0.1, 0.001, 0.09, 0.09, 0.009), (4, 0.1, 0.001, 0.03, 0.09, 0.009)]
    return [v for row in rows for v in row]


def rank_state(cfg, rank: int, tmp_path) -> SimpleNamespace:
    """A rank's step times and its profiler on demand (`slowest`), made as raylane.loop.run makes them."""
    runtime = SimpleNamespace(
        rank=rank, world_size=3, store=CheckpointStore(f"{tmp_path}/r", None, rank), device=torch.device("cpu")
    )
    slowest = _slowest_profiler(cfg, runtime)
    # Rank 0's reporter (MLflow, the driver) is tests/unit/test_step_times.py's: here nothing is reported.
    times = _step_times(cfg, runtime, SimpleNamespace(active=False), slowest)
    times.start(0, ["n0", "n1", "n2"])
    return SimpleNamespace(step_times=times, slowest=slowest)


def profiler_of(state: SimpleNamespace):
    return state.slowest.made if state.slowest is not None else None


def config(tmp_path, *more):
    sets = ["profile.enabled=true", "profile.active=2", "profile.activities=[cpu]", "stragglers.windows=2"]
    sets.append(f"mlflow.log_every_n_steps={EVERY}")
    return load_config(DIGITS, [*sets, f"run.storage_path={tmp_path}", "run.name=r", *more])


def test_the_rank_named_slowest_profiles_its_next_steps_and_no_other_does(tmp_path):
    cfg = config(tmp_path)
    assert cfg.profile.ranks == [0, "slowest"]  # the default: rank 0, and the slowest
    ranks = [rank_state(cfg, r, tmp_path) for r in range(3)]
    assert ranks[0].slowest is None  # profiled already, by number
    for window in (1, 2):
        for state in ranks:
            state.step_times.gathered(EVERY * window, gathered(), 3)
        made = [profiler_of(state) is not None for state in ranks]
        assert made == ([False, False, False] if window == 1 else [False, True, False])  # named after 2 windows
    assert ranks[1].step_times.on_named is None and ranks[2].step_times.on_named is not None  # rank 2 still watches
    x = torch.ones(16, 16)
    for step in (9, 10, 11):  # warmup 1, active 2: the trace is written after the third
        x = torch.mm(x, x) / 16
        ranks[1].slowest.on_step_end(step)  # as the Trainer tells its observers
    ranks[1].slowest.on_train_end(None)
    trace = tmp_path / "r" / "profiles" / f"trace-rank1-{socket.gethostname()}.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    # The trace's steps are the run's (named at step 8: 9 warms up, 10 and 11 recorded), not the
    # profiler's own count from its start (ProfilerStep#1-2, issue 60, finding 10).
    assert steps == {"ProfilerStep#10", "ProfilerStep#11"} and any(e.get("name") == "aten::mm" for e in events)
    tables = {f"top-ops-rank1-{socket.gethostname()}.{ext}" for ext in ("csv", "md", "txt")}
    assert {p.name for p in trace.parent.iterdir()} == {trace.name, *tables}  # rank 1's alone


def test_named_after_the_loop_or_with_slowest_left_out_no_profiler_starts(tmp_path):
    late = rank_state(config(tmp_path), 1, tmp_path)
    for window in (1, 2):  # the last window's gather is after the loop
        late.step_times.gathered(EVERY * window, gathered(), 3, in_loop=window == 1)
    assert profiler_of(late) is None
    for more in (["profile.ranks=[0]"], ["stragglers.enabled=false"], ["profile.ranks=[1,slowest]"]):
        state = rank_state(config(tmp_path, *more), 1, tmp_path)
        assert state.slowest is None, more
    assert rank_state(load_config(DIGITS), 1, tmp_path).slowest is None  # profile off: nothing made


def test_a_rank_profiled_from_a_resume_counts_the_runs_steps(tmp_path):
    """Rank 0 by number, resumed at step 40: wait 5, warmup 1, active 2 are steps 41-45, 46 and
    47-48 of the run, and the trace says so."""
    cfg = config(tmp_path, "profile.ranks=[0]", "profile.wait=5")
    runtime = SimpleNamespace(rank=0, store=CheckpointStore(f"{tmp_path}/r", None, 0), device=torch.device("cpu"))
    profiler = _profiler(cfg, runtime)
    profiler.start(40)
    x = torch.ones(16, 16)
    for step in range(41, 51):
        x = torch.mm(x, x) / 16
        profiler.step(step)
    profiler.close()
    trace = tmp_path / "r" / "profiles" / f"trace-rank0-{socket.gethostname()}.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")} == {
        "ProfilerStep#47",
        "ProfilerStep#48",
    }


def test_the_end_line_names_every_profiled_ranks_table_and_the_stragglers():
    """Rank 0's and the slowest rank's traces: both tables named, the straggler's marked (the
    line named rank 0's alone); 6 ranks profiled by number: 4 named, then how many more."""
    folder = "/runs/r/profiles"
    row = {
        "node": "n1",
        "step": 8,
        "ratio": 2.5,
        "step_s": 0.1,
        "median_s": 0.04,
        "data_share": 0.1,
        "data_bound": False,
    }
    s = TrainSummary.model_validate(
        {
            "run_name": "r",
            "status": "FINISHED",
            "stragglers": [{"rank": 1, "windows": 2, **row}],
            "profile_traces": [f"{folder}/trace-rank0-n0.json.gz", f"{folder}/trace-rank1-n1.json.gz"],
        }
    )
    line = next(x for x in outcome_text(s, "ui").splitlines() if x.startswith("  profile:"))
    assert line.endswith(
        "2 traces in /runs/r/profiles (open a trace in https://ui.perfetto.dev or chrome://tracing; top operations: "
        "top-ops-rank0-n0.md, top-ops-rank1-n1.md (the straggler's); each also .txt, .csv)"
    ), line
    many = s.model_copy(
        update={"stragglers": [], "profile_traces": [f"{folder}/trace-rank{r}-n.json.gz" for r in range(6)]}
    )
    line = next(x for x in outcome_text(many, "ui").splitlines() if x.startswith("  profile:"))
    assert (
        "top operations: top-ops-rank0-n.md, top-ops-rank1-n.md, top-ops-rank2-n.md, top-ops-rank3-n.md, 2 more;"
        in line
    )
