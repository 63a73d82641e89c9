"""B15: the driver's own paths at 2, 256 and 1,024 simulated ranks (issue 63), their cost per
logging window: time, bytes, MLflow entries, memory over many windows. No cluster: each path is
fed what N ranks send, shaped as the real types are, in one process (8 ranks a node):

- **step times** (raylane.loop.observe.steptimes): rank 0's `StepTimes.gathered` on the vote's
  per-rank block of N ranks (a node of 8 slow ranks among them), in process; the vote's buffer
  on torch's `fake` process group of world size N (its bytes, not its time).
- **hangs** (raylane.loop.observe.hangs): real `HangWatch.diagnose`s of a collective's timeout,
  by the first rank and by a second, over a run folder holding the other ranks' records and
  watchdog dumps (on other hosts: nothing is signalled), one rank stuck in user code; their
  sleeps on a virtual clock (the wait asked for is counted, not slept). At N ranks, N-1 ranks
  time out together: the run's files are the first's and N-2 times the second's.
- **preemption vote** (raylane.loop.stopping.StepVote.poll) on the fake group: its bytes.
- **checkpoint commit** (raylane.loop.checkpoint.writing/agree/manifest): a real
  `PendingSave.commit` of a sharded save by rank 0 on the fake group, the other ranks' parts put
  in its gather as they would send them (each rank's shard and generators' files): its bytes,
  the manifest it writes of N ranks' files, its time; and an upload's agreement's bytes.
- **MLflow** (raylane.loop.reporting.Reporter, raylane.tracking.health.HealthWatch): the metrics
  and tags rank 0's window and the driver's health poll of N/8 nodes' files (8 GPUs each) log.
- **events** (raylane.loop.protocols.events to raylane.tracking.progress.ProgressDisplay): the
  events a window sends the driver (pickled bytes), and the start's one `Startup` per rank.

`python -m scripts.benchmarks.driverscale N` measures one N (scripts/benchmarks/driverpaths.py),
a process each (a fake group per process); `b15` runs the three and fits each figure's growth
from 256 to 1,024 ranks (its exponent: 1 linear, 0 flat). Wall times on a loaded 2-core machine
are noisy: the lines executed, bytes and entries are exact."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from scripts.benchmarks.driverpaths import WINDOWS, measure

RANKS = (2, 256, 1024)

# What each row of the table reads: (path, figure, its key in `measure`'s result).
FIGURES = (
    ("step times", "rank 0's work per window (ms)", ("step_times", "window_ms")),
    ("step times", "lines executed per window", ("step_times", "lines")),
    ("step times", "vote's bytes per window", ("step_times", "vote_bytes")),
    ("step times", "MLflow entries, most in a window", ("step_times", "mlflow_max_window")),
    ("step times", "memory growth over the windows (bytes)", ("step_times", "memory_growth_bytes")),
    ("hang", "the collecting rank's diagnosis (ms)", ("hang", "rank_ms")),
    ("hang", "the collecting rank's lines executed", ("hang", "rank_lines")),
    ("hang", "every other timed-out rank's (ms)", ("hang", "other_rank_ms")),
    ("hang", "every other timed-out rank's lines executed", ("hang", "other_rank_lines")),
    ("hang", "its wait for the stacks (s; bound 3 s)", ("hang", "rank_waited_s")),
    ("hang", "stack files written, the whole run", ("hang", "run_files_written")),
    ("hang", "the line's length (chars)", ("hang", "line_chars")),
    ("preemption", "vote's bytes between windows", ("preemption", "vote_bytes")),
    ("checkpoint", "commit's bytes on rank 0", ("checkpoint", "commit_bytes")),
    ("checkpoint", "an upload's agreement bytes", ("checkpoint", "agree_bytes")),
    ("checkpoint", "manifest bytes", ("checkpoint", "manifest_bytes")),
    ("checkpoint", "files the manifest lists", ("checkpoint", "manifest_files")),
    ("checkpoint", "rank 0's commit: gather, manifest written (ms)", ("checkpoint", "commit_ms")),
    ("checkpoint", "rank 0's commit: lines executed", ("checkpoint", "commit_lines")),
    ("MLflow", "train metrics per window", ("mlflow", "train_metrics_per_window")),
    ("MLflow", "health metrics per interval", ("mlflow", "health_metrics_per_interval")),
    ("MLflow", "driver's health poll (ms)", ("mlflow", "health_poll_ms")),
    ("MLflow", "driver's health poll: lines executed", ("mlflow", "health_poll_lines")),
    ("events", "a window's events to the driver (bytes)", ("events", "window_bytes")),
    ("events", "the start's events (bytes, once)", ("events", "start_bytes")),
    ("events", "lines for a warning every rank relays", ("events", "warning_lines_same_text")),
)


def exponent(small: float, large: float, ratio: float = 4.0) -> float | None:
    """The growth's exponent from 256 to 1,024 ranks: 1 is linear, 2 quadratic, 0 flat."""
    if small <= 0 or large <= 0:
        return None
    return math.log(large / small) / math.log(ratio)


def b15(bench: Any) -> dict[str, Any]:
    windows = WINDOWS // 3 if bench.quick else WINDOWS
    print(
        f"[bench] B15 the driver's paths at {', '.join(map(str, RANKS))} simulated ranks, {windows} windows", flush=True
    )
    by_n: dict[str, Any] = {}
    for n in RANKS:
        out = subprocess.run(
            [sys.executable, "-m", "scripts.benchmarks.driverscale", str(n), str(windows)],
            capture_output=True, text=True, env=bench.env, cwd=str(Path(__file__).resolve().parents[2]), timeout=900,
        )  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"B15 at {n} ranks: {out.stderr[-2000:]}")
        by_n[str(n)] = json.loads(out.stdout.strip().splitlines()[-1])
    table = []
    for path, what, (part, key) in FIGURES:
        values = [by_n[str(n)][part][key] for n in RANKS]
        table.append({"path": path, "figure": what, "values": values, "exponent": exponent(values[1], values[2])})
    return {"ranks": list(RANKS), "windows": windows, "by_ranks": by_n, "table": table}


def rows(r: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    """The report's lines: each figure at 2 / 256 / 1,024 ranks and its growth's exponent."""
    if not r or "table" not in r:
        return []
    out = []
    for row in r["table"]:
        values = " / ".join(_figure(v) for v in row["values"])
        k = row["exponent"]
        grows = "flat" if k is None or abs(k) < 0.1 else f"n^{k:.2f}"
        timed = "(ms)" in row["figure"]  # best-of wall time on a shared machine: its lines-executed row is exact
        out.append(
            ("B15", f"{row['path']}: {row['figure']}, at {' / '.join(map(str, r['ranks']))} ranks", f"{values} ({grows})",
             "≤ linear (time: best of, load-dependent)" if timed else "≤ linear", _met(k is None or k <= 1.1))
        )  # fmt: skip
    return out


def _figure(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


if __name__ == "__main__":
    print(json.dumps(measure(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else WINDOWS)))
