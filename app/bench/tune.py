"""Benchmark B4 (see raylane.bench.harness): a `raylane tune` sweep against its ideal (every trial's own
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
    from raylane.bench.harness import PY, REPO, stats

    print("[bench] B4 Tune sweep against its ideal and plain Ray Tune", flush=True)
    lrs = LRS[:2] if bench.quick else LRS

    def raylane() -> dict[str, Any]:
        n = bench._n + 1
        out, sweep = bench.work / f"b4-raylane-{n}.json", bench.work / f"b4-sweep-{n}.yaml"
        # A sweep of its own each repeat: a sweep name that exists is resumed, not run again.
        sweep.write_text(yaml.safe_dump({
            "sweep": {"name": f"bench-b4-{n}", "base": "digits", "space": {"optim.lr": {"grid": lrs}},
                      "algorithm": "grid", "scheduler": "fifo", "max_concurrent_trials": CONCURRENCY,
                      "metric": "accuracy", "mode": "max"},
            "train": {"max_epochs": EPOCHS}, "scaling": {"num_workers": 2},
            "checkpoint": {"every_n_steps": 0}, "mlflow": {"system_metrics": False}}))
        times = bench.run([PY, "-m", "raylane", "tune", str(sweep), "--set", f"run.storage_path={bench.work / 'runs'}",
                           "--summary-json", str(out)])
        s = json.loads(out.read_text())
        return {"process_s": times["exited"] - times["launched"], **s["timing"]}

    def plain() -> dict[str, Any]:
        out = bench.work / f"b4-plain-{bench._n + 1}.json"
        times = bench.run([PY, str(REPO / "scripts" / "plain_tune.py"), "--lrs", ",".join(map(str, lrs)),
                           "--epochs", str(EPOCHS), "--concurrency", str(CONCURRENCY), "--json", str(out)])
        return {"process_s": times["exited"] - times["launched"], **json.loads(out.read_text())}

    runs = bench.interleaved({"raylane tune": raylane, "plain Ray Tune": plain})
    wall = {side: [r["process_s"] for r in rs] for side, rs in runs.items()}
    return {"trials": len(lrs), "epochs": EPOCHS, "concurrency": CONCURRENCY,
            "ideal_over_wall": stats([r["ideal_s"] / r["wall_s"] for r in runs["raylane tune"]]),
            "plain_ideal_over_wall": stats([r["ideal_s"] / r["wall_s"] for r in runs["plain Ray Tune"]]),
            "wall_s": {side: stats(v) for side, v in wall.items()},
            "raylane_over_plain": statistics.median(wall["raylane tune"]) / statistics.median(wall["plain Ray Tune"])}
