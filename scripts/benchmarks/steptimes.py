"""B13: what timing every rank's steps and naming stragglers costs (raylane.loop.observe.steptimes): the
per-step slope of the tutorial's workload (`regression`, 2 torchrun ranks) with step timing on
(the default) ÷ off (`stragglers.enabled=false`: no timer, nothing extra on the step-boundary
vote). The sides run interleaved; the spread between identical runs of a side says what
difference the machine can show."""

from __future__ import annotations

import statistics
from typing import Any

from scripts.benchmarks.common import QUIET, stats

STEPS = (200, 1200)  # short and long run; --quick: half
SIDES = {"step timing on": [], "step timing off": ["stragglers.enabled=false"]}
TARGET = 0.01  # of a step


def b13(bench: Any) -> dict[str, Any]:
    short, long = (n // 2 for n in STEPS) if bench.quick else STEPS
    repeats = max(bench.repeats, 3)  # a spread needs a few runs of each side
    print(f"[bench] B13 step timing on ÷ off, regression: {short} and {long} steps, {repeats} repeats", flush=True)
    pairs: dict[str, list[tuple[Any, Any]]] = {side: [] for side in SIDES}
    for i in range(repeats):
        for side in list(SIDES)[:: 1 if i % 2 == 0 else -1]:  # on first, then off first: no side always leads
            extra = SIDES[side]
            sets = [*QUIET, *extra, "train.max_epochs=1000000", "scaling.num_workers=2"]
            pairs[side].append(
                tuple(
                    bench.raylane("regression", [*sets, f"train.max_steps={n}"], launcher="torchrun")
                    for n in (short, long)
                )
            )
            print(f"[bench]   {side}: done", flush=True)
    out: dict[str, Any] = {"steps": [short, long], "repeats": repeats}
    for key, prefix in (("train_s", ""), ("train_cpu_s", "cpu_")):
        slopes = {
            side: [(b[key] - a[key]) / (b["steps"] - a["steps"]) * 1e3 for a, b in runs] for side, runs in pairs.items()
        }
        on, off = (statistics.median(slopes[side]) for side in SIDES)
        out[f"{prefix}step_ms"] = {side: stats(v) for side, v in slopes.items()}
        out[f"{prefix}on_over_off"] = on / off
        # The spread between identical runs: what a difference must exceed to be seen.
        out[f"{prefix}spread"] = max((max(v) - min(v)) / statistics.median(v) for v in slopes.values())
    return out


def rows(r: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    """The report's lines: wall time and rank 0's CPU time per step, on ÷ off."""
    if not r or "step_ms" not in r:
        return []
    out = []
    for prefix, what in (("", "wall"), ("cpu_", "rank 0's CPU time")):
        ratio, spread = r[f"{prefix}on_over_off"], r[f"{prefix}spread"]
        ms = r[f"{prefix}step_ms"]
        on, off = (f"{ms[s]['median']:.3f} [{ms[s]['min']:.3f}–{ms[s]['max']:.3f}]" for s in SIDES)
        seen = abs(ratio - 1) > spread
        out.append(
            (
                "B13",
                f"step timing and stragglers on ÷ off, `regression`, 2 torchrun ranks: {what} per step",
                f"{ratio:.3f} ({on} vs {off} ms; identical runs spread ±{spread / 2:.0%}"
                + ("" if seen else ": within noise")
                + ")",
                "≤ 1.01",
                _met(ratio <= 1 + TARGET or not seen),
            )
        )
    return out


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"
