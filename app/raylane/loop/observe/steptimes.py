"""Every rank's step times, and the stragglers they name. Ray-free.

Each rank times its steps with `perf_counter` alone (no device sync): the wait for its batch, the
time until it reaches the gradient sync (its data, its forward, the micro-batches before the last),
the forward and backward, the optimizer, the whole step (`StepTimer`). The ranks' figures are not
gathered by a collective of their own: each logging window's ride on the next step-boundary vote
(raylane.loop.stopping), which every rank makes anyway, as a few more numbers in its all-reduce.

Under data parallelism every rank leaves the gradient sync together, so the whole step takes as
long on every rank; what tells a slow rank is how late it reached the sync. A rank's busy time is
its step less the time it waited there for the last one (`busy_times`); rank 0 compares the ranks'
busy times every window (`window_figures`), names a rank slower than the other ranks' median by
`stragglers.factor` for `stragglers.windows` windows running, once (`StragglerWatch`), and keeps
each rank's totals for the run's per-rank table (`RankTable`). What MLflow gets per window is a few
aggregates whatever the world size; the per-rank table is one artifact at the end."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from raylane.loop.observe.observer import Observer

# Per rank and window, in this order: steps, then the means of the whole step, the data wait, the
# time to reach the gradient sync, forward and backward, and the optimizer.
FIGURES = ("steps", "step_s", "data_s", "arrive_s", "compute_s", "optim_s")
# A rank that waits on data this share of its busy time is data-bound.
DATA_BOUND_SHARE = 0.5


class StepTimer:
    """This rank's step times over the current window. The Trainer marks each step's moments;
    `take` gives the window's means (FIGURES) and starts the next window."""

    __slots__ = ("_t", "_fetched", "_arrived", "_computed", "_sums", "steps")

    def __init__(self) -> None:
        self._t = self._fetched = self._arrived = self._computed = 0.0
        self._sums = [0.0] * (len(FIGURES) - 1)
        self.steps = 0

    def begin(self) -> None:
        """Before the step's batch is asked for."""
        self._t = time.perf_counter()

    def fetched(self) -> None:
        self._fetched = self._arrived = time.perf_counter()

    def arrive(self) -> None:
        """Before the backward that syncs the gradients (the last micro-batch's)."""
        self._arrived = time.perf_counter()

    def computed(self) -> None:
        """After the last backward: the optimizer's part starts."""
        self._computed = time.perf_counter()

    def ended(self) -> None:
        now = time.perf_counter()
        computed = max(self._computed, self._fetched)
        s = self._sums
        s[0] += now - self._t
        s[1] += self._fetched - self._t
        s[2] += self._arrived - self._t
        s[3] += computed - self._fetched
        s[4] += now - computed
        self.steps += 1

    def take(self) -> tuple[float, ...]:
        """The window's (steps, mean step, data, arrival, compute, optimizer); resets."""
        n = max(self.steps, 1)
        out = (float(self.steps), *(v / n for v in self._sums))
        self._sums = [0.0] * (len(FIGURES) - 1)
        self.steps = 0
        return out


class OffTimer:
    """`stragglers.enabled: false`: the Trainer's marks cost a call that does nothing."""

    __slots__ = ()
    steps = 0

    def begin(self) -> None:
        pass

    fetched = arrive = computed = ended = begin

    def take(self) -> tuple[float, ...]:
        return ()  # never asked: an off collector is never due


def busy_times(rows: list[tuple[float, ...]]) -> list[float]:
    """Each rank's busy step time: its step less the time it waited at the gradient sync for the
    last rank to arrive (that rank waited none)."""
    latest = max(r[3] for r in rows)
    return [max(r[1] - (latest - r[3]), 0.0) for r in rows]


def window_figures(rows: list[tuple[float, ...]], nodes: list[str]) -> dict[str, Any]:
    """One window's figures over the ranks that stepped in it: min, median and max busy step
    time, the slowest rank and its node, its data wait share and the median rank's."""
    ranks = [i for i, r in enumerate(rows) if r[0] > 0]
    if not ranks:
        return {}
    stepped = [rows[i] for i in ranks]
    busy = busy_times(stepped)
    median = statistics.median(busy)
    slowest = max(range(len(ranks)), key=lambda i: busy[i])
    others = statistics.median(busy[:slowest] + busy[slowest + 1 :]) if len(busy) > 1 else busy[slowest]
    shares = [min(r[2] / b, 1.0) if b > 0 else 0.0 for r, b in zip(stepped, busy, strict=True)]
    rank = ranks[slowest]
    return {
        "busy": dict(zip(ranks, busy, strict=True)),
        "shares": dict(zip(ranks, shares, strict=True)),
        "metrics": {
            "steps/step_s_min": min(busy),
            "steps/step_s_median": median,
            "steps/step_s_max": busy[slowest],
            "steps/slowest_rank": float(rank),
            "steps/slowest_vs_others": busy[slowest] / others if others > 0 else 1.0,
            "steps/slowest_data_share": shares[slowest],
            "steps/data_share_median": statistics.median(shares),
        },
        "median": median,
        "slowest": rank,
        "node": nodes[rank] if rank < len(nodes) else "?",
    }


@dataclass
class Straggler:
    """A rank named as slow: the summary's record of it."""

    rank: int
    node: str
    step: int  # the step of the window that named it
    ratio: float  # its busy step time over the median of the other ranks'
    step_s: float
    median_s: float
    data_share: float
    data_bound: bool
    windows: int

    def line(self) -> str:
        waits = f"it waits on data {self.data_share:.0%} of its step"
        why = f"{waits} (data-bound)" if self.data_bound else f"{waits}: its own compute is slow"
        return (
            f"straggler: rank {self.rank} on {self.node} takes {self.ratio:.1f}x the other ranks' median step "
            f"({self.step_s:.3f} s vs {self.median_s:.3f} s) for {self.windows} windows running, to step "
            f"{self.step}; {why}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class StragglerWatch:
    """Names a rank whose busy step time is `factor` times the median's for `windows` windows
    running, once per rank."""

    factor: float
    windows: int
    streaks: dict[int, int] = field(default_factory=dict)
    named: list[Straggler] = field(default_factory=list)

    def observe(self, step: int, figures: dict[str, Any]) -> list[Straggler]:
        """The window's figures (window_figures); returns the ranks named by this window."""
        if not figures:
            return []
        new = []
        order = sorted(figures["busy"], key=figures["busy"].get)  # O(n log n) a window, at 256 ranks too
        values = [figures["busy"][r] for r in order]
        for at, rank in enumerate(order):
            busy = values[at]
            median = median_without(values, at)  # the others': at 2 ranks, the other one's
            slow = median > 0 and busy > self.factor * median
            self.streaks[rank] = self.streaks.get(rank, 0) + 1 if slow else 0
            if self.streaks[rank] == self.windows and all(s.rank != rank for s in self.named):
                share = figures["shares"][rank]
                node = figures["nodes"][rank] if "nodes" in figures else "?"
                new.append(
                    Straggler(
                        rank, node, step, round(busy / median, 3), round(busy, 6), round(median, 6),
                        round(share, 3), share >= DATA_BOUND_SHARE, self.windows,
                    )
                )  # fmt: skip
        self.named += new
        return new


def median_without(values: list[float], at: int) -> float:
    """The median of sorted `values` without the one at index `at` (0.0 when none is left)."""
    n = len(values) - 1
    if n <= 0:
        return 0.0

    def nth(i: int) -> float:
        return values[i] if i < at else values[i + 1]

    return nth(n // 2) if n % 2 else (nth(n // 2 - 1) + nth(n // 2)) / 2


class RankTable:
    """Each rank's totals over the windows gathered: the run's per-rank table."""

    COLUMNS = ("rank", "node", "steps", "step_s", "busy_s", "data_s", "compute_s", "optim_s", "data_share")

    def __init__(self, nodes: list[str]) -> None:
        self.nodes = nodes
        self.sums: dict[int, list[float]] = {}

    def add(self, rows: list[tuple[float, ...]], busy: dict[int, float]) -> None:
        for rank, b in busy.items():
            n, step, data, _, compute, optim = rows[rank]
            s = self.sums.setdefault(rank, [0.0] * 6)
            for i, v in enumerate((n, n * step, n * b, n * data, n * compute, n * optim)):
                s[i] += v

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for rank in sorted(self.sums):
            n, step, busy, data, compute, optim = self.sums[rank]
            d = max(n, 1.0)
            out.append(
                {
                    "rank": rank,
                    "node": self.nodes[rank] if rank < len(self.nodes) else "?",
                    "steps": int(n),
                    "step_s": step / d,
                    "busy_s": busy / d,
                    "data_s": data / d,
                    "compute_s": compute / d,
                    "optim_s": optim / d,
                    "data_share": min(data / busy, 1.0) if busy > 0 else 0.0,
                }
            )
        return out


class FigureSink(Protocol):
    """Where rank 0's window figures go (raylane.loop.reporting.Reporter: MLflow and the driver)."""

    active: bool

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def on_straggler(self, straggler: dict[str, Any], line: str) -> None: ...


class StepTimes(Observer):
    """What the Trainer holds: this rank's timer, driven by the loop's moments (a step's start,
    its batch in hand, its end) and its own marks inside a step; which windows ride on which vote
    (`due`: the same answer on every rank, from the step alone); what the gathered figures give
    (`gathered`: on rank 0, MLflow's aggregates and a straggler to `sink`; on a rank that profiles
    itself once named the slowest, `on_named`)."""

    def __init__(
        self,
        every: int,
        factor: float,
        windows: int,
        *,
        active: bool,
        enabled: bool = True,
        rank: int = 0,
        sink: FigureSink | None = None,
        on_named: Callable[[int], None] | None = None,
    ) -> None:
        # Off: no clock read, nothing gathered (no window is ever due), no last gather after the loop.
        self.timer: StepTimer | OffTimer = StepTimer() if enabled else OffTimer()
        self.enabled = enabled
        self.every = every
        self.active = active and enabled
        self.rank, self.sink, self.on_named = rank, sink, on_named
        self.nodes: list[str] = []
        self.watch = StragglerWatch(factor, windows)
        self.table = RankTable(self.nodes)
        self._gathered_at = 0

    # The loop's moments: a slow loader's wait counts as the data's (a fault's `slowdata` sleeps
    # after `on_step_start`), a slow step's as its compute (`slow` sleeps after `on_batch`).
    def on_step_start(self, step: int) -> None:
        self.timer.begin()

    def on_batch(self, step: int) -> None:
        self.timer.fetched()

    def on_step_end(self, step: int) -> None:
        self.timer.ended()

    def start(self, step: int, nodes: list[str]) -> None:
        self._gathered_at = step
        self.nodes[:] = nodes

    def due(self, step: int) -> bool:
        """A logging window ended since the last gather."""
        return self.enabled and step // self.every > self._gathered_at // self.every

    def take(self, step: int) -> tuple[float, ...]:
        self._gathered_at = step
        return self.timer.take()

    def window(self, step: int, rows: list[tuple[float, ...]]) -> tuple[dict[str, float], list[Straggler]]:
        """Rank 0: the gathered window's metrics for MLflow, and the ranks it names."""
        if not self.active:
            return {}, []
        figures = window_figures(rows, self.nodes)
        if not figures:
            return {}, []
        figures["nodes"] = {r: self.nodes[r] if r < len(self.nodes) else "?" for r in figures["busy"]}
        self.table.add(rows, figures["busy"])
        return figures["metrics"], self.watch.observe(step, figures)

    def gathered(self, step: int, values: list[float], world_size: int, *, in_loop: bool = True) -> None:
        """A window's step times from every rank (gathered on a vote, `values`): on rank 0, its
        aggregates to MLflow and a rank it names as a straggler to the driver (once). On a rank
        that profiles itself once named the slowest (profile.ranks: `slowest`), the same naming,
        from the same figures (every rank holds them, bit for bit, after the vote's all-reduce),
        calls `on_named` with the step, once, in the loop only: no rank tells another."""
        reports = self.sink is not None and self.sink.active
        if not values or not (reports or self.on_named):
            return
        metrics, named = self.window(step, split_rows(values, world_size))
        if reports and self.sink is not None:
            if metrics:
                self.sink.log_metrics(metrics, step)
            for straggler in named:
                self.sink.on_straggler(straggler.to_dict(), straggler.line())
        if in_loop and self.on_named and any(s.rank == self.rank for s in named):
            call, self.on_named = self.on_named, None  # once: a rank is named once
            call(step)

    def stragglers(self) -> list[dict[str, Any]]:
        """The ranks named, for the run's result (rank 0's)."""
        return [s.to_dict() for s in self.watch.named]


def split_rows(values: list[float], world_size: int) -> list[tuple[float, ...]]:
    """The vote's per-rank block as one row of FIGURES per rank."""
    k = len(FIGURES)
    return [tuple(values[r * k : (r + 1) * k]) for r in range(world_size)]
