"""What `raylane autotune` shows and writes of its candidates: a line each, the table, the plot,
the summary's rows, the MLflow metrics and the winner's YAML. Each ok candidate's figure is the
median of its measured windows with an interval (raylane.autotuning.ranking); its verdict is
`winner`, `tie` (its interval overlaps the leader's) or `slower`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from raylane.autotuning.ranking import Ranking
from raylane.config import BaseConfig
from raylane.loop.protocols.result import Fit, Outcome

METRIC_KEYS = (
    "samples_per_s",
    "tokens_per_s",
    "mfu",
    "step_time_s",
    "peak_memory_bytes",
    "estimated_bytes",
    "eval_s",
    "save_s",
    "rounds",
)


def describe(c: Outcome) -> str:
    """The candidate's line: its values, and its figure or why it has none."""
    v = c.values
    text = (
        f"{v.get('strategy.name')}, micro-batch {v.get('train.batch_size')} x {c.grad_accum_steps}, "
        f"{v.get('train.precision')}"
    )
    extras = [
        k.split(".")[-1] + ("" if val is True else f"={val}")
        for k, val in v.items()
        if k not in ("strategy.name", "train.batch_size", "train.precision") and val not in (False, None)
    ]
    extras = [e for e in extras if not e.startswith(("bucket_cap_mb=25.0", "reshard_after_forward", "comm_hook=none"))]
    text += "".join(f", {e}" for e in extras)
    if c.status != Fit.OK:
        return f"{text}: {c.status}" + (f" ({c.error})" if c.error else "")
    peak = c.peak_memory_bytes
    text = f"{text}: {rate(c)} samples/s" + (f", peak {peak / 2**20:.0f} MiB" if peak else "")
    return text + (f" (round not measured: {c.round_error})" if c.round_error else "")


def rate(c: Outcome) -> str:
    """'1234.5 [1100.2-1302.7]': the median and its interval."""
    low, high = c.interval or (None, None)
    return f"{c.samples_per_s:.1f}" + (f" [{low:.1f}-{high:.1f}]" if low is not None else "")


def verdict_of(index: int, c: Outcome, ranking: Ranking | None) -> str | None:
    if not ranking or not c.ok:
        return None
    if index == ranking.winner:
        return "winner"
    return "tie" if index in ranking.ties else "slower"


def chosen_line(candidates: list[Outcome], ranking: Ranking) -> str:
    best = ranking.winner
    text = f"candidate {best}, {describe(candidates[best])}"
    others = [i for i in ranking.ties if i != best]
    if not others:
        return f"fastest: {text}; clearly (no other interval overlaps its)"
    return (
        f"chosen: {text}; the simplest of {len(others) + 1} candidates tied within the noise "
        f"(with {', '.join(map(str, others))}; the highest median: {ranking.leader})"
    )


def row(c: Outcome, index: int, ranking: Ranking | None, run_id: str | None) -> dict[str, Any]:
    """A candidate in the summary (raylane.results.Candidate's fields)."""
    return {
        "config": c.values,
        "status": c.status.value,
        "samples_per_s": c.samples_per_s,
        "interval": c.interval,
        "rounds": c.rounds,
        "windows": c.windows,
        "window_s": c.window_s,
        "verdict": verdict_of(index, c, ranking),
        "eval_s": c.eval_s,
        "save_s": c.save_s,
        "tokens_per_s": c.tokens_per_s,
        "grad_accum_steps": c.grad_accum_steps,
        "peak_memory_bytes": c.peak_memory_bytes,
        "estimated_bytes": c.estimated_bytes,
        "profile_s": c.profile_s,
        "setup_s": c.setup_s,
        "error": c.error or c.round_error,
        "pid": c.pid,
        "run_id": run_id,
    }


def metrics(c: Outcome, step: int) -> list[Any]:
    """A candidate's figures as MLflow metrics at `step` (its round): the interval as
    samples_per_s_low and samples_per_s_high."""
    from mlflow.entities import Metric

    values = {k: getattr(c, k) for k in METRIC_KEYS}
    if c.interval:
        values["samples_per_s_low"], values["samples_per_s_high"] = c.interval
    stamp = int(time.time() * 1000)
    return [
        Metric(k, float(v), stamp, step)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]


def write_yaml(path: str, cfg: BaseConfig, best: Outcome, ties: list[int]) -> None:
    tree = cfg.model_dump(mode="json")
    tree["run"]["name"] = None  # a new run each time it is trained
    how = (
        "the fastest of its candidates"
        if len(ties) <= 1
        else f"the simplest of the {len(ties)} candidates tied within the noise for the fastest"
    )
    header = (
        f"# Written by `raylane autotune`: {how}, {rate(best)} samples/s on {cfg.scaling.num_workers} workers\n"
        f"# (the median of its measured windows [interval], epoch ends' evaluation and checkpoint included).\n"
        f"# Train it with: raylane train {path}\n"
    )
    Path(path).write_text(header + yaml.safe_dump(tree, sort_keys=False))


def table(candidates: list[Outcome], space_keys: list[str], ranking: Ranking | None = None) -> str:
    varied = [k for k in space_keys if len({json.dumps(c.values.get(k)) for c in candidates}) > 1]
    header = [
        "#",
        *["strategy" if k == "strategy.name" else k.split(".")[-1] for k in varied],
        "accum",
        "status",
        "samples/s",
        "interval",
        "rounds",
        "verdict",
        "peak MiB",
        "est. MiB",
    ]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for i, c in enumerate(candidates):
        mib = [f"{b / 2**20:.0f}" if b is not None else "-" for b in (c.peak_memory_bytes, c.estimated_bytes)]
        speed = f"{c.samples_per_s:.1f}" if c.samples_per_s else "-"
        low, high = c.interval or (None, None)
        span = f"{low:.1f}-{high:.1f}" if low is not None and c.samples_per_s else "-"
        lines.append(
            " | ".join(
                [
                    str(i),
                    *[str(c.values.get(k)) for k in varied],
                    "-" if c.grad_accum_steps is None else str(c.grad_accum_steps),
                    c.status.value,
                    speed,
                    span,
                    str(c.rounds or "-"),
                    verdict_of(i, c, ranking) or "-",
                    *mib,
                ]
            )
        )
    return "\n".join(lines)


def plot(path: Path, candidates: list[Outcome]) -> None:
    """Throughput (the median, its interval as an error bar) against peak memory; infeasible
    candidates marked at their estimate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = [(i, c) for i, c in enumerate(candidates) if c.ok]
    x = [(c.peak_memory_bytes or 0) / 2**20 for _, c in ok]
    y = [c.samples_per_s or 0.0 for _, c in ok]
    spans = [c.interval or (m, m) for (_, c), m in zip(ok, y, strict=True)]
    ax.errorbar(
        x,
        y,
        yerr=[[m - s[0] for m, s in zip(y, spans, strict=True)], [s[1] - m for m, s in zip(y, spans, strict=True)]],
        fmt="o",
        capsize=3,
        label="fits (median, interval)",
    )
    for (i, _), xi, yi in zip(ok, x, y, strict=True):
        ax.annotate(str(i), (xi, yi), fontsize=8)
    bad = [c for c in candidates if c.status != Fit.OK]
    if bad:
        ax.scatter(
            [(c.estimated_bytes or 0) / 2**20 for c in bad],
            [0] * len(bad),
            marker="x",
            color="red",
            label="out of memory, pruned or failed (at its estimate)",
        )
    ax.set_xlabel("peak memory per rank (MiB)")
    ax.set_ylabel("samples/s")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def estimate_error(candidates: list[Outcome], device: str | None) -> float | None:
    """Median of measured peak / estimate - 1 over the candidates that ran; None when none did,
    or on CPU, whose measured figure is the resident set's growth, not the tensors' peak."""
    if device != "cuda":
        return None
    ratios = sorted(
        c.peak_memory_bytes / c.estimated_bytes - 1
        for c in candidates
        if c.status == Fit.OK and c.estimated_bytes and c.peak_memory_bytes
    )
    return ratios[len(ratios) // 2] if ratios else None
