"""Benchmark B4 (see scripts.benchmarks.harness): a `raylane tune` sweep against its ideal (every trial's own
time, perfectly packed) and against plain Ray Tune running the same training
(scripts/plain_tune.py), interleaved."""

from __future__ import annotations

import json
import statistics
from typing import Any

import yaml

LRS = [0.001, 0.002, 0.003, 0.004]
EPOCHS, CONCURRENCY = 2, 2


def b4(bench) -> dict[str, Any]:
    from scripts.benchmarks.common import PY, REPO, stats

    print("[bench] B4 Tune sweep against its ideal and plain Ray Tune", flush=True)
    lrs = LRS[:2] if bench.quick else LRS

    def raylane() -> dict[str, Any]:
        n = bench._n + 1
        out, sweep = bench.work / f"b4-raylane-{n}.json", bench.work / f"b4-sweep-{n}.yaml"
        # A sweep of its own each repeat: a sweep name that exists is resumed, not run again.
        sweep.write_text(
            yaml.safe_dump(
                {
                    "sweep": {
                        "name": f"bench-b4-{n}",
                        "base": "digits",
                        "space": {"optim.lr": {"grid": lrs}},
                        "algorithm": "grid",
                        "scheduler": "fifo",
                        "max_concurrent_trials": CONCURRENCY,
                        "metric": "accuracy",
                        "mode": "max",
                    },
                    "train": {"max_epochs": EPOCHS},
                    "scaling": {"num_workers": 2},
                    "checkpoint": {"every_n_steps": 0},
                    "mlflow": {"system_metrics": False},
                }
            )
        )
        times = bench.run(
            [
                PY,
                "-m",
                "raylane",
                "tune",
                str(sweep),
                "--set",
                f"run.storage_path={bench.work / 'runs'}",
                "--summary-json",
                str(out),
            ]
        )
        s = json.loads(out.read_text())
        return {"process_s": times["exited"] - times["launched"], **s["timing"]}

    def plain() -> dict[str, Any]:
        out = bench.work / f"b4-plain-{bench._n + 1}.json"
        times = bench.run(
            [
                PY,
                str(REPO / "scripts" / "plain_tune.py"),
                "--lrs",
                ",".join(map(str, lrs)),
                "--epochs",
                str(EPOCHS),
                "--concurrency",
                str(CONCURRENCY),
                "--json",
                str(out),
            ]
        )
        return {"process_s": times["exited"] - times["launched"], **json.loads(out.read_text())}

    runs = bench.interleaved({"raylane tune": raylane, "plain Ray Tune": plain})
    wall = {side: [r["process_s"] for r in rs] for side, rs in runs.items()}
    return {
        "trials": len(lrs),
        "epochs": EPOCHS,
        "concurrency": CONCURRENCY,
        "ideal_over_wall": stats([r["ideal_s"] / r["wall_s"] for r in runs["raylane tune"]]),
        "plain_ideal_over_wall": stats([r["ideal_s"] / r["wall_s"] for r in runs["plain Ray Tune"]]),
        "wall_s": {side: stats(v) for side, v in wall.items()},
        "raylane_over_plain": statistics.median(wall["raylane tune"]) / statistics.median(wall["plain Ray Tune"]),
    }


# B10: an autotune wide enough for 12+ candidates on 2 CPU ranks (a global batch of 64 sequences).
B10_SETS = [
    "scaling.num_workers=2",
    "autotune.global_batch=64",
    "autotune.batch_sizes=[32, 16, 8, 4, 2]",
    "autotune.bucket_cap_mb=[25, 2, 5, 50, 100]",
    "autotune.profile_steps=50",
    "mlflow.system_metrics=false",
]
# Inside gpt-tiny's first epoch (103 steps of 64 sequences): no evaluation or epoch-end save in the
# measured steps. Without MLflow, as the search measured: on 2 cores a Ray run's driver prepares
# its end-of-run records (~5 s of CPU) while a short run trains (B9), and B5 prices tracking.
B10_PLAIN_SETS = ["train.max_steps=100", "mlflow.enabled=false"]


def b10(bench) -> dict[str, Any]:
    """Autotune of gpt-tiny on 2 Ray workers: its wall time against one cold start plus the
    candidates' profiling; then a plain `raylane train` of the winner's YAML, whose throughput
    should match what the search measured for it."""
    from scripts.benchmarks.common import PY, stats

    print("[bench] B10 autotune of gpt-tiny, and a plain run of its choice", flush=True)
    sets = B10_SETS if not bench.quick else [*B10_SETS[:-2], "autotune.profile_steps=10", B10_SETS[-1]]
    runs = []
    for _ in range(bench.repeats):
        n = bench._n + 1
        summary, chosen = bench.work / f"b10-{n}.json", bench.work / f"b10-{n}.yaml"
        times = bench.run(
            [
                PY,
                "-m",
                "raylane",
                "autotune",
                "gpt-tiny",
                "--set",
                f"run.storage_path={bench.work / 'runs'}",
                "--set",
                f"run.name=b10-{n}",
                *[x for s in sets for x in ("--set", s)],
                "--out",
                str(chosen),
                "--summary-json",
                str(summary),
            ]
        )
        s = json.loads(summary.read_text())
        plain = bench.raylane(str(chosen), B10_PLAIN_SETS)
        t = s["timing"]
        runs.append(
            {
                "candidates": len(s["candidates"]),
                "wall_s": t["wall_s"],
                "startup_s": t["startup_s"],
                "profiling_s": t["profiling_s"],
                "process_s": times["exited"] - times["launched"],
                "overhead": (t["wall_s"] - t["startup_s"]) / t["profiling_s"],
                "best": s["best"]["config"],
                "autotune_samples_per_s": s["best"]["samples_per_s"],
                "plain_samples_per_s": plain["summary"]["samples_per_s"],
            }
        )
        print(f"[bench]   autotune: {runs[-1]['candidates']} candidates in {t['wall_s']:.1f} s", flush=True)
    return {
        "runs": runs,
        "candidates": stats([r["candidates"] for r in runs]),
        "wall_s": stats([r["wall_s"] for r in runs]),
        "startup_s": stats([r["startup_s"] for r in runs]),
        "profiling_s": stats([r["profiling_s"] for r in runs]),
        "search_over_profiling": stats([r["overhead"] for r in runs]),
        "plain_over_autotune": stats([r["plain_samples_per_s"] / r["autotune_samples_per_s"] for r in runs]),
        "winners": [r["best"] for r in runs],
        "median_of": statistics.median([r["candidates"] for r in runs]),
    }
