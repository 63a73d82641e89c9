"""The benchmark harness runs end to end (`raylane bench --quick`): real runs of raylane on Ray,
under torchrun, and the hand-written DDP loop under torchrun and in a plain TorchTrainer, then results.json, results.md and the charts.
No speed is asserted here: targets live in `make bench` (docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray


@pytest.mark.slow  # ~50 s of two torchrun runs; make test checks the report from results (tests/unit/test_bench_report.py)
def test_bench_runs_a_row_end_to_end_and_writes_its_results(tmp_path):
    """The harness's path from real runs to results.json and results.md, on its cheapest row (B6:
    two torchrun runs). B1 and B2 with their charts run in the slow test below (`make test-all`)."""
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "raylane", "bench", "--quick", "--only", "B6", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert set(report["results"]) == {"B6"} and report["machine"]["cpus"] >= 1
    assert 0.4 < report["results"]["B6"]["fsdp_over_ddp"]["median"] < 0.6
    assert (out / "results.md").read_text().count("\n| B6 |") == 1


@pytest.mark.slow
def test_quick_bench_writes_results_table_and_charts(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "raylane", "bench", "--quick", "--only", "B1,B2,B6", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    b1 = report["results"]["B1"]["regression"]
    assert set(b1["step_ms"]) == {
        "raylane on Ray",
        "raylane under torchrun",
        "hand-written torchrun DDP",
        "hand-written loop on plain Ray Train",
    }
    for side, s in b1["step_ms"].items():
        assert 0 < s["median"] < 1000 and s["n"] == 1, (side, s)
        assert math.isclose(
            b1["ratio_vs_hand_written"][side], s["median"] / b1["step_ms"]["hand-written torchrun DDP"]["median"]
        )
        cpu = b1["cpu_step_ms"][side]["median"]
        assert 0 < cpu < 1000 and math.isclose(
            b1["cpu_ratio_vs_hand_written"][side], cpu / b1["cpu_step_ms"]["hand-written torchrun DDP"]["median"]
        )
    b2 = report["results"]["B2"]
    assert {
        "raylane on Ray",
        "raylane on Ray, MLflow on",
        "hand-written torchrun DDP",
        "hand-written loop on plain Ray Train",
    } <= set(b2)
    for side, r in b2.items():
        assert 0 < r["launch_to_first_step_s"]["median"] < 300 and 0 < r["last_step_to_exit_s"]["median"] < 300, side
    # FSDP shards parameters, gradients and Adam state over 2 ranks: about half of DDP's.
    assert 0.4 < report["results"]["B6"]["fsdp_over_ddp"]["median"] < 0.6
    table = (out / "results.md").read_text()
    assert (
        table.count("\n| B1 |") == 4
        and "raylane on Ray ÷ hand-written loop on plain Ray Train" in table
        and "| B6 |" in table
        and report["machine"]["cpus"] >= 1
    )
    for chart in ("b1_step_cost.png", "b2_startup.png"):
        assert (out / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_unknown_benchmarks_and_bad_repeats(tmp_path):
    for args, field in ((["--only", "B1,B99"], "B99"), (["--repeats", "0"], "--repeats")):
        proc = subprocess.run(
            [sys.executable, "-m", "raylane", "bench", *args, "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and field in proc.stderr and "Traceback" not in proc.stderr
        assert not (tmp_path / "results.json").exists()
