"""The driver's live display: a bar on a terminal, periodic plain lines in a log (`ray job logs`),
and the block a finished run ends with.

It consumes the events rank 0 publishes (raylane.loop.protocols.events) and remembers what the summary needs
(first and last step times, the final result). Training figures are always shown with the steps
they cover: the display, the summary and MLflow's train/* metrics give the same window the same
numbers, and the whole run's throughput is named as such."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import IO, Any

from raylane.config import EPOCHS_AS_NEEDED
from raylane.loop.observe.steptimes import Straggler as StepStraggler
from raylane.loop.protocols.events import (
    Checkpoint,
    CheckpointFailed,
    End,
    Eval,
    Event,
    FirstStep,
    Handover,
    Log,
    Progress,
    ReplicaQuorum,
    Start,
    Straggler,
)
from raylane.loop.protocols.result import RunResult
from raylane.loop.reporting import MAX_STRAGGLERS_NAMED
from raylane.results import Experts, TrainSummary
from raylane.tracking.observe import profile_line

LINE_INTERVAL_S = 10.0
LABEL_WIDTH = 15


def plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def epochs_text(steps: int, epochs: int, steps_per_epoch: int | None, *, partial: float | None = None) -> str:
    """'1 epoch', '12 epochs', or the fraction a max_steps stop ran: '0.2 epoch', '2.6 epochs'.
    `partial`: the share of the last, unfinished epoch that ran, as the loop counted it (exact across a
    resume that changed the steps per epoch); else it is worked out from `steps_per_epoch`."""
    if partial is not None:
        if not partial:
            return plural(epochs, "epoch")
        fraction = epochs + partial
    elif not steps_per_epoch or steps == epochs * steps_per_epoch:
        return plural(epochs, "epoch")
    else:
        fraction = steps / steps_per_epoch
    if fraction < 0.01:
        return "under 0.01 epoch"
    return f"{fraction:.2f} epoch" if fraction < 1 else f"{fraction:.1f} epochs"


def figures(window: dict[str, Any] | None, with_loss: bool = True) -> str:
    """'loss 0.1234 1,132 samples/s', as measured over `window`'s steps."""
    if not window:
        return ""
    parts = [f"loss {window['loss']:.4f}"] if with_loss and "loss" in window else []
    if "samples_per_s" in window:
        parts.append(f"{window['samples_per_s']:,.0f} samples/s")
    if "tokens_per_s" in window:
        parts.append(f"{window['tokens_per_s']:,.0f} tokens/s")
    if "real_tokens_per_s" in window:  # rows that hold padding: what of it was data
        parts.append(f"({window['real_tokens_per_s']:,.0f} real)")
    return " ".join(parts)


def window_span(window: dict[str, Any]) -> str:
    first, last = window["first_step"], window["last_step"]
    return f"step {last}" if first == last else f"steps {first}-{last}"


def _fmt_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressDisplay:
    def __init__(
        self, stream: IO[str] | None = None, live: bool | None = None, line_interval_s: float = LINE_INTERVAL_S
    ) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.line_interval_s = line_interval_s
        self.info: dict[str, Any] = {}
        self.first_step_unix: float | None = None
        self.end_unix: float | None = None
        self.result: RunResult | None = None
        self.checkpoints: list[Checkpoint] = []
        self.skipped_checkpoints: list[dict[str, str]] = []  # passed over by a resume: {"path", "reason"}
        self.starts = 0
        self.first_steps_unix: list[float] = []
        self._last_line = float("-inf")
        self._rate_origin: tuple[float, int] | None = None  # (time, step) of the first progress seen
        self._bar = None
        self._task = None
        self._warned: set[str] = set()
        self._short_since: int | None = None  # the step from which fewer replica groups step together

    # Events from rank 0 ---------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        match event:
            case Start():
                self._started(event)
            case FirstStep():
                self.first_step_unix = self.first_step_unix or event.time_unix
                self.first_steps_unix.append(event.time_unix)  # one per (re)start of the group
            case Progress():
                self.info.update(event.state, epoch=event.epoch, step=event.step)
                if event.window is not None:
                    self.info["window"] = event.window
                self._show()
            case Eval() if event.metrics:  # none: a run without held-out data ended (nothing to say)
                shown = " ".join(f"{k} {v:.4f}" for k, v in sorted(event.metrics.items()))
                at = f"epoch {event.epoch + 1}" if event.epoch_end else f"step {event.step}"
                self._print(f"{at} eval: {shown}")
            case Checkpoint():
                self.checkpoints.append(event)
            case CheckpointFailed():
                self._print(f"warning: {event.error}")
            case Log():
                self._relayed(event)
            case Straggler():
                self._print(event.line)
            case ReplicaQuorum():
                self._quorum(event)
            case Handover(result=r):
                then = "larger" if r.stop_reason == "more workers fit" else "without the leaving node"
                self._print(
                    f"{r.stop_reason or 'a node is leaving'}: checkpointed at step {r.steps}; the group restarts {then}"
                )
            case End(result=RunResult() as r):
                self.end_unix = event.time_unix
                self.result = r
                # The epoch the last step was in: the one a stop cut short, else the last one ended.
                running = r.epochs if r.partial_epoch else max(r.epochs - 1, 0)
                self.info.update(step=r.steps, epoch=running)
                if r.last_window:
                    self.info["window"] = r.last_window  # the last steps', not a stale one
                self._show(force=True)

    def _started(self, event: Start) -> None:
        self.starts += 1
        if self.starts > 1:
            self._print(f"worker group restarted ({self.starts - 1})")
        self.info.update((f.name, getattr(event, f.name)) for f in dataclasses.fields(event))
        if self.starts == 1 and event.strategy:
            blocks = event.strategy_tags.get("raylane.strategy.blocks", "")
            blocks = f"; blocks: {blocks}" if blocks else ""
            self._print(f"strategy {event.strategy} ({event.strategy_reason}){blocks}")
        self._start_bar()
        self._skipped(event)
        if self.starts == 1 and event.resumed_layout:
            self._print(event.resumed_layout)
        if event.resumed_from_step:
            self._print(f"resumed from step {event.resumed_from_step}")

    def _skipped(self, event: Start) -> None:
        """Each checkpoint a resume passed over, once (every restart of the group reports it)."""
        then = f"resuming from {event.resumed_from}" if event.resumed_from else "training from the start"
        for skipped in event.skipped_checkpoints:
            if all(skipped["path"] != s["path"] for s in self.skipped_checkpoints):
                self.skipped_checkpoints.append(skipped)
                self._print(f"{skipped['path'].rstrip('/').rsplit('/', 1)[-1]} skipped: {skipped['reason']}; {then}")

    def _relayed(self, event: Log) -> None:
        """A worker's raylane warning; once, when every rank says the same."""
        if event.message in self._warned:
            return
        self._warned.add(event.message)
        rank = f" (rank {event.rank})" if self.info.get("world_size", 1) > 1 else ""
        self._print(f"{event.level}{rank}: {event.message}")

    # Rendering ------------------------------------------------------------------------------

    def _start_bar(self) -> None:
        if not self.live or self._bar is not None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._task = self._bar.add_task("training", total=self.info.get("total_steps"), stats="")
        self._bar.start()

    def _show(self, force: bool = False) -> None:
        step, total = self.info.get("step", 0), self.info.get("total_steps") or 0
        epoch = self.info.get("epoch", 0) + 1
        window = self.info.get("window")
        stats = [f"{figures(window)} ({window_span(window)})"] if window else []
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=step,
                description=self._epoch_text(epoch),
                stats=" ".join(stats),
            )
            return
        now = time.monotonic()
        self._rate_origin = self._rate_origin or (now, step)
        if not force and now - self._last_line < self.line_interval_s:
            return
        self._last_line = now
        pct = 100.0 * step / total if total else 0.0
        # ETA from the pace of this launch only: resumed steps and start-up do not count.
        t0, step0 = self._rate_origin
        eta = _fmt_eta((now - t0) / (step - step0) * (total - step)) if step > step0 else "?"
        line = f"{self._epoch_text(epoch)} step {step}/{total} ({pct:.0f}%)"
        self._print(" ".join([line, *stats, f"eta {eta}"]))

    def _quorum(self, event: ReplicaQuorum) -> None:
        """The replica groups that step together changed (the leading group says): a loss, and a
        return with the steps the others took meanwhile. A group's restart and its heal are said by
        the driver (raylane.onray.replicas) and by the healed group (raylane.loop.distributed.ft)."""
        if event.alive < event.groups:
            self._short_since = event.step if self._short_since is None else self._short_since
            self._print(f"replica groups: {event.alive} of {event.groups} step on from step {event.step}")
        elif self._short_since is not None:
            meanwhile = plural(event.step - self._short_since, "step")
            self._print(
                f"replica groups: all {event.groups} step together again from step {event.step} "
                f"(the others took {meanwhile} meanwhile)"
            )
            self._short_since = None

    def _epoch_text(self, epoch: int) -> str:
        """'epoch 2/5'; 'epoch 2' when train.max_steps alone ends the run."""
        limit = self.info.get("max_epochs", "?")
        return f"epoch {epoch}" if isinstance(limit, int) and limit >= EPOCHS_AS_NEEDED else f"epoch {epoch}/{limit}"

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(f"[raylane] {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _speed_rows(s: TrainSummary) -> list[tuple[str, str]]:
    """The train loss and throughput over the last window, the whole run's, and the share of the
    tokens that were data where rows hold padding."""
    rows: list[tuple[str, str]] = []
    window = s.last_window.model_dump(exclude_none=True) if s.last_window else None
    if window and "loss" in window:
        rows.append(("train loss", f"{window['loss']:.4f} ({window_span(window)}, rank 0)"))
    rates = (
        [f"{figures(window, with_loss=False)} ({window_span(window)})"] if window and "samples_per_s" in window else []
    )
    whole = {"samples_per_s": s.samples_per_s, "tokens_per_s": s.tokens_per_s, "real_tokens_per_s": s.real_tokens_per_s}
    if text := figures({k: v for k, v in whole.items() if v is not None}):
        rates.append(f"{text} (whole run)")
    if rates:
        rows.append(("throughput", ", ".join(rates)))
    if s.packing_efficiency is not None:
        rows.append(("packing", f"{s.packing_efficiency:.1%} of the tokens were data, the rest padding (rank 0)"))
    return rows


def experts_text(e: Experts) -> str:
    """`2 modules x 4 experts, ep2; tokens per expert min 120 max 410 (imbalance 1.80x), 0
    dropped`: the run's over every rank (the summary's `experts`)."""
    line = f"{e.modules} modules x {e.experts} experts, ep{e.ep}; tokens per expert min {e.tokens_min:,} max {e.tokens_max:,}"
    if e.imbalance is not None:
        line += f" (imbalance {e.imbalance:.2f}x)"
    if e.capacity_factor is None:
        return line + f", {e.dropped:,} dropped (no capacity)"
    return line + f", {e.dropped:,} of {e.routed:,} dropped at capacity factor {e.capacity_factor:g}"


def outcome_text(summary: TrainSummary, ui: str, log_file: Any = None) -> str:
    """The block a run ends with. Each figure names what it measures: the eval metrics the step
    they were taken at, train loss and throughput the window of steps they cover (the last line of
    the progress display, and MLflow's train/* at that step), the run's throughput the whole run."""
    s = summary
    rows: list[tuple[str, str]] = []
    if s.error:
        rows.append(("error", s.error))
    if s.resumed_from_step:
        rows.append(("resumed from", f"step {s.resumed_from_step}"))
    nodes = len(set(s.node_ranks or [0]))
    if s.steps is not None:
        rows.append(
            (
                "steps",
                f"{s.steps:,} in {epochs_text(s.steps, s.epochs or 0, s.steps_per_epoch, partial=s.partial_epoch)}"
                f" on {plural(s.world_size or 0, 'worker')}"
                + (f" in {s.replicas.groups} replica groups" if s.replicas else "")
                + (f" across {plural(nodes, 'node')}" if nodes > 1 else ""),
            )
        )
    rows += _speed_rows(s)
    metrics = " ".join(f"{k} {v:.4f}" for k, v in sorted(s.metrics.items()))
    rows.append(("eval", metrics or "-"))
    if s.early_stopped:
        rows.append(("stopped", s.stop_reason or "early stopping"))
    skipping = {k: v for k, v in s.skipped_rows.items() if v.skipped or not v.counts}
    if skipping:  # data.skip_bad_rows: how much, and where to look first
        counts = ", ".join(f"{k} {v.skipped:,} of {v.rows:,}" for k, v in skipping.items())
        first = next((v.first for v in skipping.values() if v.first), None)
        rows.append(("skipped rows", counts + (f"; the first: {first}" if first else "")))
    for key, v in s.skipped_rows.items():  # what the data's transform counted: examples cut, unanswered
        if v.counts:
            rows.append(("examples", f"{key}: " + ", ".join(f"{n:,} {what}" for what, n in sorted(v.counts.items()))))
    if s.experts is not None:
        rows.append(("experts", experts_text(s.experts)))
    shown = s.stragglers[:MAX_STRAGGLERS_NAMED]  # the summary's JSON has every one
    rows += [("straggler", StepStraggler(**x.model_dump()).line().removeprefix("straggler: ")) for x in shown]
    if len(s.stragglers) > len(shown):
        rows.append(("straggler", f"and {len(s.stragglers) - len(shown)} more ranks (the summary lists them)"))
    if s.profile_traces or s.memory_snapshots:
        slow = [x.rank for x in s.stragglers]
        rows.append(("profile", profile_line(s.profile_traces, s.memory_snapshots, slow)))
    rows.append(("MLflow run id", s.run_id) if s.run_id else ("MLflow", "not recorded"))
    rows.append(("checkpoint", s.checkpoint or "none"))
    if s.model_uri:
        rows.append(("model", s.model_uri))
    if s.run_id:
        rows.append(("MLflow UI", ui))
    if log_file:
        rows.append(("library log", f"{log_file} (Ray, MLflow, torch; --verbose prints them)"))
    lines = [f"run {s.run_name}: {s.status}"]
    lines += [f"  {label + ':':<{LABEL_WIDTH}}{text}" for label, text in rows]
    return "\n".join(lines)
