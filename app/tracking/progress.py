"""The driver's live display: a bar on a terminal, periodic plain lines in a log (`ray job logs`).

It consumes the events rank 0 publishes (see raylane.loop.reporting) and remembers what the summary needs
(first and last step times, the final result)."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

LINE_INTERVAL_S = 10.0


def _fmt_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressDisplay:
    def __init__(self, stream: IO[str] | None = None, live: bool | None = None,
                 line_interval_s: float = LINE_INTERVAL_S) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self.line_interval_s = line_interval_s
        self.info: dict[str, Any] = {}
        self.first_step_unix: float | None = None
        self.end_unix: float | None = None
        self.result: dict[str, Any] | None = None
        self.checkpoints: list[dict[str, Any]] = []
        self.starts = 0
        self.first_steps_unix: list[float] = []
        self._last_line = float("-inf")
        self._rate_origin: tuple[float, int] | None = None  # (time, step) of the first progress seen
        self._bar = None
        self._task = None

    # Events from rank 0 ---------------------------------------------------------------------

    def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "start":
            self.starts += 1
            if self.starts > 1:
                self._print(f"worker group restarted ({self.starts - 1})")
            self.info.update({k: v for k, v in event.items() if k != "event"})
            if self.starts == 1 and event.get("strategy"):
                self._print(f"strategy {event['strategy']} ({event.get('strategy_reason', '')})")
            self._start_bar()
            if event.get("resumed_from_step"):
                self._print(f"resumed from step {event['resumed_from_step']}")
        elif kind == "first_step":
            self.first_step_unix = self.first_step_unix or event["time_unix"]
            self.first_steps_unix.append(event["time_unix"])  # one per (re)start of the group
        elif kind == "progress":
            self.info.update({k: v for k, v in event.items() if k != "event"})
            self._show()
        elif kind == "eval":
            shown = " ".join(f"{k} {v:.4f}" for k, v in sorted(event["metrics"].items()))
            self._print(f"epoch {event['epoch'] + 1} eval: {shown}")
        elif kind == "checkpoint":
            self.checkpoints.append(event)
        elif kind == "checkpoint_failed":
            self._print(f"warning: {event['error']}")
        elif kind == "end":
            self.end_unix = event["time_unix"]
            self.result = event["result"]
            self.info.update(step=self.result["steps"], epoch=max(self.result["epochs"] - 1, 0))
            self._show(force=True)

    # Rendering ------------------------------------------------------------------------------

    def _start_bar(self) -> None:
        if not self.live or self._bar is not None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"), TimeRemainingColumn(), transient=False,
        )
        self._task = self._bar.add_task("training", total=self.info.get("total_steps"), stats="")
        self._bar.start()

    def _show(self, force: bool = False) -> None:
        step, total = self.info.get("step", 0), self.info.get("total_steps") or 0
        epoch = self.info.get("epoch", 0) + 1
        stats = []
        if "loss" in self.info:
            stats.append(f"loss {self.info['loss']:.4f}")
        if "samples_per_s" in self.info:
            stats.append(f"{self.info['samples_per_s']:,.0f} samples/s")
        if self._bar is not None:
            self._bar.update(self._task, completed=step, description=f"epoch {epoch}/{self.info.get('max_epochs', '?')}",
                             stats=" ".join(stats))
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
        line = f"epoch {epoch}/{self.info.get('max_epochs', '?')} step {step}/{total} ({pct:.0f}%)"
        self._print(" ".join([line, *stats, f"eta {eta}"]))

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text)
        else:
            print(f"[raylane] {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
