"""`raylane autotune`: one worker group profiles every candidate (strategy, micro-batch at a held
global batch, precision, recompute, bucket size, ...), agrees on an out-of-memory error on any
rank, records a child MLflow run per candidate and writes the winner as a YAML that trains."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import yaml

from tests.conftest import TORCHRUN, cli_env, read_json


def _children(db: Path, parent_id: str) -> dict[str, tuple[str, str]]:
    """run id -> (status, raylane.autotune.status) of the parent's children."""
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
            "WHERE t.key = 'mlflow.parentRunId' AND t.value = ?",
            (parent_id,),
        ).fetchall()
        return {
            run: (
                status,
                con.execute(
                    "SELECT value FROM tags WHERE run_uuid = ? AND key = ?", (run, "raylane.autotune.status")
                ).fetchone()[0],
            )
            for run, status in rows
        }


@pytest.mark.slow  # ~37 s; autotune on Ray and the search order stay in make test
@pytest.mark.shared_ray
def test_autotune_under_torchrun_agrees_on_one_ranks_oom_and_its_winner_trains(run_cli, tmp_path):
    """Rank 1 alone runs out of memory (injected: a CPU has no device memory to exhaust) at a
    micro-batch of 16: both ranks record that candidate infeasible and the search goes on."""
    env = cli_env(tmp_path, RAYLANE_FAULTS="oom@rank=1,batch=16")
    p = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        "autotune",
        "gpt-tiny",
        "--set",
        "run.name=tiny-at",
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
        "--summary-json",
        str(tmp_path / "a.json"),
        "--set",
        "autotune.max_rounds=2",
        "--set",
        "autotune.profile_steps=5",
        "--set",
        "autotune.min_window_s=0",
        launcher=TORCHRUN,
        env=env,
        name="autotune",
    )
    assert p.wait(300) == 0, p.output
    s = read_json(tmp_path / "a.json")
    candidates = s["candidates"]
    assert s["status"] == "FINISHED" and len(candidates) >= 8, s
    big = [c for c in candidates if c["config"]["train.batch_size"] >= 16]
    assert big and all(c["status"] == "oom" and c["error"] == "out of memory on rank 1" for c in big), big
    ok = [c for c in candidates if c["status"] == "ok"]
    assert {c["config"]["strategy.name"] for c in ok} == {"ddp", "fsdp"}
    for c in candidates:  # the global batch is held: 32 samples a step, however they are split
        assert c["status"] != "ok" or c["config"]["train.batch_size"] * c["grad_accum_steps"] * 2 == 32, c
    _assert_ranked(s)
    assert s["timing"]["profiling_s"] > 0 and s["timing"]["wall_s"] > s["timing"]["startup_s"] > 0
    children = _children(tmp_path / "mlflow.db", s["parent_run_id"])
    assert sorted(c["run_id"] for c in candidates) == sorted(children)
    assert {children[c["run_id"]] for c in big} == {("FAILED", "oom")}
    assert "[autotune] 0: ddp, micro-batch 16 x 1, fp32: oom (out of memory on rank 1)" in p.output
    assert (tmp_path / "runs" / "tiny-at" / "autotune.jsonl").exists()

    winner = Path(s["best"]["yaml"])
    written = yaml.safe_load(winner.read_text())
    for key, value in s["best"]["config"].items():
        section, name = key.split(".")
        assert written[section][name] == value, key
    t = run_cli(
        "train",
        str(winner),
        "--set",
        "train.max_steps=6",
        "--set",
        "mlflow.log_model=false",
        "--summary-json",
        str(tmp_path / "t.json"),
        name="winner",
    )
    assert t.wait(300) == 0, t.output
    assert read_json(tmp_path / "t.json")["status"] == "FINISHED"


@pytest.mark.shared_ray
def test_autotune_of_an_own_pipeline_on_ray_runs_in_one_worker_group(run_cli, tmp_path):
    from tests.e2e.test_cluster_e2e import EXAMPLE

    p = run_cli(
        "autotune",
        str(EXAMPLE / "train.yaml"),
        "--set",
        "scaling.num_workers=2",
        "--set",
        "autotune.strategies=[ddp]",
        "--set",
        "autotune.precisions=[fp32]",
        "--set",
        "autotune.activation_checkpointing=[false]",
        "--set",
        "autotune.bucket_cap_mb=[25, 1]",
        "--set",
        "autotune.max_rounds=2",
        "--set",
        "autotune.profile_steps=5",
        "--set",
        "autotune.min_window_s=0",
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
        "--out",
        str(tmp_path / "best.yaml"),
        "--summary-json",
        str(tmp_path / "a.json"),
        name="autotune",
    )
    assert p.wait(300) == 0, p.output
    s = read_json(tmp_path / "a.json")
    ok = [c for c in s["candidates"] if c["status"] == "ok"]
    assert len(ok) >= 3 and len({c["config"]["train.batch_size"] for c in ok}) >= 2, s["candidates"]
    _assert_ranked(s)
    # The leader and the config's own values are measured at least twice (autotune.min_rounds).
    assert s["candidates"][s["ranking"]["leader"]]["rounds"] >= 2 and s["candidates"][0]["rounds"] >= 2
    assert "| samples/s | interval | rounds | verdict |" in p.output
    best = s["candidates"][s["best"]["candidate"]]
    assert f"{best['samples_per_s']:.1f} [{best['interval'][0]:.1f}-{best['interval'][1]:.1f}] samples/s" in p.output
    # Each child run has the interval, logged again at each later round.
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        steps = con.execute(
            "SELECT step FROM metrics WHERE run_uuid = ? AND key = 'samples_per_s_low'", (best["run_id"],)
        ).fetchall()
        verdicts = dict(con.execute("SELECT run_uuid, value FROM tags WHERE key = 'raylane.autotune.verdict'"))
    assert sorted(step for (step,) in steps) == list(range(1, best["rounds"] + 1))
    assert verdicts[best["run_id"]] == "winner" and {c["run_id"]: c["verdict"] for c in ok} == verdicts
    assert (tmp_path / "best.yaml").exists() and s["best"]["yaml"] == str(tmp_path / "best.yaml")
    # Start-up was paid once: every candidate ran in the same rank-0 worker process.
    assert len({c["pid"] for c in s["candidates"] if c["status"] == "ok"}) == 1
    # A second search never overwrites the first one's result.
    again = run_cli("autotune", str(EXAMPLE / "train.yaml"), "--out", str(tmp_path / "best.yaml"), name="again")
    assert again.wait(60) == 2
    assert "--out = " in again.output and "already exists" in again.output and "Traceback" not in again.output


def _assert_ranked(s: dict) -> None:
    """Every candidate that ran has a median and an interval over its windows (5 a round); the
    leader has the highest median; the winner is the simplest of those whose interval overlaps
    the leader's, and these are reported as ties."""
    from raylane.autotuning.ranking import median_interval

    ok = [c for c in s["candidates"] if c["status"] == "ok"]
    for c in ok:
        assert c["rounds"] >= 1 and [len(w) for w in c["windows"]] == [5] * c["rounds"], c
        assert [c["samples_per_s"], *c["interval"]] == list(median_interval(c["windows"]))
        assert c["interval"][0] <= c["samples_per_s"] <= c["interval"][1], c
    ranking, candidates = s["ranking"], s["candidates"]
    lead = candidates[ranking["leader"]]
    assert lead["samples_per_s"] == max(c["samples_per_s"] for c in ok)
    ties = [
        i
        for i, c in enumerate(candidates)
        if c["status"] == "ok"
        and not (c["interval"][1] < lead["interval"][0] or c["interval"][0] > lead["interval"][1])
    ]
    assert sorted(ranking["ties"]) == ties and ranking["clear"] == (len(ties) == 1)
    assert ranking["winner"] == ranking["ties"][0]  # simplest first (tests/unit/test_autotune_ranking.py)
    assert [c["verdict"] for c in candidates] == [
        None if c["status"] != "ok" else "winner" if i == ranking["winner"] else "tie" if i in ties else "slower"
        for i, c in enumerate(candidates)
    ]
    assert (
        s["best"]["candidate"] == ranking["winner"]
        and s["best"]["interval"] == candidates[ranking["winner"]]["interval"]
    )
    assert s["best"]["tied_with"] == ranking["ties"][1:]


def test_the_search_order_finds_the_largest_micro_batch_that_fits_then_tries_each_knob():
    from raylane.autotuning.order import plan
    from raylane.loop.protocols.result import Fit, Outcome

    space = {
        "strategy.name": ["ddp"],
        "train.batch_size": [1, 2, 4, 8, 16, 32],
        "train.precision": ["fp32", "bf16"],
        "train.activation_checkpointing": [False, True],
    }
    speed = {1: 10.0, 2: 30.0, 4: 50.0, 8: 60.0}  # 16 and 32 do not fit without recompute
    tried = []
    search = plan(space)
    outcome = None
    while True:
        try:
            values = search.send(outcome) if outcome else next(search)
        except StopIteration:
            break
        tried.append((values["train.batch_size"], values["train.precision"], values["train.activation_checkpointing"]))
        size = values["train.batch_size"]
        fits = size in speed or (values["train.activation_checkpointing"] and size == 16)
        rate = speed.get(size, 70.0) * (0.5 if values["train.precision"] == "bf16" else 1.0)
        outcome = Outcome(values, Fit.OK, samples_per_s=rate) if fits else Outcome(values, Fit.OOM)
    # 32 first; a binary search (4, 16) finds 8; the scan down goes on to a third size (2), then
    # stops, slower; then the knobs from (8, fp32), recompute with the next larger micro-batch too.
    assert tried == [
        (32, "fp32", False),
        (4, "fp32", False),
        (16, "fp32", False),
        (8, "fp32", False),
        (2, "fp32", False),
        (8, "bf16", False),
        (8, "fp32", True),
        (16, "fp32", True),
    ]
    assert len(tried) == len(set(tried))  # never the same candidate twice


@pytest.mark.parametrize(
    "bad, message",
    [
        ("autotune.batch_sizes=[3]", "autotune.batch_sizes = [3]: 3 does not divide the 16 samples"),
        ("autotune.profile_steps=0", "autotune.profile_steps = 0"),
        ("autotune.profile_steps=3", "autotune.profile_steps = 3: fewer than autotune.windows = 5"),
        ("autotune.min_rounds=5", "autotune.min_rounds = 5: more than autotune.max_rounds = 4"),
        ("autotune.global_batch=33", "autotune.global_batch = 33: not a multiple of scaling.num_workers = 2"),
    ],
)
def test_bad_autotune_input_exits_2_naming_the_field(run_cli, bad, message):
    p = run_cli("autotune", "gpt-tiny", "--set", bad, name="bad")
    assert p.wait(60) == 2
    assert message in p.output and "Traceback" not in p.output
