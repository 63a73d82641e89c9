"""Under torchrun, a rank's failure said by rank 0: the one line, the rank, its host and its log.

On Ray each rank's exception reaches the driver with the group's failure (raylane.onray.failures).
torchrun passes nothing between its ranks: a rank that raises exits, torchrun SIGTERMs the others,
and rank 0 (which closes the MLflow run and writes the summary) saw only that signal, or its own
echo of the failure ("Connection closed by peer"). So a rank whose run failed with an error of
its own appends one record to torchrun's store (the TCPStore every rank of the group reaches,
held by torchrun's agent, which outlives its ranks), before it exits: its rank, its one line,
when, its host, its library log and its traceback. torchrun stops the others only once that rank
has exited, so the record is there before rank 0 hears of the failure; rank 0 reads the records
when its own run ended in an echo or a signal, and says the first error by time.

An echo (`is_echo`) is what a rank raises because another one failed: a peer gone from a
collective, or a collective's timeout. Echoes are not recorded: at 256 ranks one fault would
otherwise write 255 records of "Connection closed by peer". Every wait here is bounded
(`STORE_TIMEOUT_S`, `READ_WAIT_S`); a store that cannot be reached costs the line, never the run's
close. Ray-free; torch's store is imported only when a record is written or read."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

KEY = "raylane/failures"
STORE_TIMEOUT_S = 3.0  # each request; connecting to a store that is gone takes about twice as long
READ_WAIT_S = 3.0  # how long rank 0 waits for a record after an echo or a signal
POLL_S = 0.1
MAX_TRACEBACK = 20_000  # characters of a rank's traceback carried to rank 0's library log
MAX_SHOWN = 3  # distinct errors in the one line; the rest are counted
# What gloo, NCCL and torch.distributed raise on a rank whose peer failed or left (the peer's
# socket closed, a collective timed out or was aborted): never the cause of a failure.
_ECHOES = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|timed out waiting|"
    r"application timeout caused pair closure|nccl communicator was aborted|watchdog caught collective|"
    r"remote process exited|ncclremoteerror|socket closed",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure, as it said it: `line` is the one line its own summary would show."""

    rank: int
    line: str
    time_unix: float
    host: str
    log: str | None = None  # its library log (raylane.logs), where its whole traceback is
    traceback: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RankFailure | None:
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError):
            return None  # a record cut short (its rank killed mid-write): the others still count


def is_echo(exc: BaseException) -> bool:
    """Whether `exc` is this rank's echo of another rank's failure (see the module's doc): its
    message, or one of those it was raised from, is a peer gone or a collective's timeout.
    raylane's hang report (raylane.loop.observe.hangs.HangError) is no echo: it names the ranks that
    never came, and where they stood."""
    from raylane.loop.observe.hangs import HangError

    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, HangError):
            return False
        if _ECHOES.search(str(current)):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _store(timeout_s: float | None = None) -> Any:
    """A client of torchrun's store (MASTER_ADDR:MASTER_PORT: torchrun's agent's, or rank 0's
    where the agent shares none), or None outside a group of several ranks."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=STORE_TIMEOUT_S if timeout_s is None else timeout_s)
    return dist.TCPStore(addr, int(port), is_master=False, timeout=timeout)


def publish(rank: int, line: str, traceback: str = "", log: str | None = None) -> bool:
    """Record this rank's failure for rank 0 (once, before the rank exits); False when the store
    could not be reached (the failure is then only in this rank's log, as before)."""
    record = RankFailure(rank, line, time.time(), socket.gethostname(), log, traceback[-MAX_TRACEBACK:])
    try:
        store = _store()
        if store is None:
            return False
        store.append(KEY, record.to_json() + "\n")
        store.check([KEY])  # a round trip: the append has reached the store before this rank exits
        return True
    except Exception:  # noqa: BLE001 - saying the failure must never add one
        return False


def recorded(wait_s: float = 0.0) -> list[RankFailure]:
    """The failures the ranks have recorded, waiting up to `wait_s` for a first one; [] when there
    is none (or no store: one process, or it cannot be reached)."""
    deadline = time.monotonic() + wait_s
    try:
        store = _store(min(STORE_TIMEOUT_S, max(wait_s, 1.0)))
        while store is not None:
            if store.check([KEY]):
                text = store.get(KEY).decode(errors="replace")
                return [f for line in text.splitlines() if line.strip() and (f := RankFailure.from_json(line))]
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
    except Exception:  # noqa: BLE001 - no store, no line: the caller says its own
        pass
    return []


def first_line(failures: list[RankFailure]) -> str:
    """The one line for the ranks' failures, as on Ray (raylane.onray.failures.format_failure):
    the first error by time first, the ranks that failed alike together."""
    ranks: dict[str, list[int]] = {}
    for failure in sorted(failures, key=lambda f: (f.time_unix, f.rank)):
        ranks.setdefault(failure.line, [])
        if failure.rank not in ranks[failure.line]:
            ranks[failure.line].append(failure.rank)
    shown = list(ranks.items())[:MAX_SHOWN]
    parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, sorted(r)))}: {text}" for text, r in shown]
    more = len(ranks) - len(shown)
    return "training failed on " + "; ".join(parts) + (f" (and {more} other error{'s' * (more > 1)})" if more else "")


def said(failures: list[RankFailure]) -> list[RankFailure]:
    """The failures `first_line` names (each rank once): whose logs and tracebacks rank 0 passes on."""
    lines = list(dict.fromkeys(f.line for f in sorted(failures, key=lambda f: (f.time_unix, f.rank))))[:MAX_SHOWN]
    kept: dict[int, RankFailure] = {}
    for failure in failures:
        if failure.line in lines:
            kept.setdefault(failure.rank, failure)
    return [kept[r] for r in sorted(kept)]
