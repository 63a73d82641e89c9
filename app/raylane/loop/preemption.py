"""Graceful stop on a preemption notice: SIGTERM (a scheduler, a spot reclaim, `ray job stop`) or
Ctrl-C asks; every rank agrees on the same step boundary (see `raylane.loop.distributed.groups.ControlVote`);
the loop checkpoints there and returns, so a relaunch loses no steps.

The request is process-wide: a signal handler, or the launcher relaying the driver's signal, sets
it; the Trainer reads it once per step. A request may say that only this rank's node is leaving
(a spot reclaim's SIGTERM to a Ray worker, Ray's drain notice): the ranks still checkpoint at the
agreed step, and a launcher that can go on without the node (an elastic run on Ray) restarts the
group on the others from that checkpoint instead of ending the run. The launcher may also ask
for a handover to a larger group (`request_growth`). A signal while no loop is armed, or a second
one after `ESCALATE_AFTER_S`, goes to the previous handler (normally: exit now), except in a
process installed with `early=True` (a Ray worker), which keeps a signal that comes while its
group is still starting: the loop checkpoints at its first agreed step. Ray-free."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

# torchrun's agent forwards the terminal's Ctrl-C as SIGTERM to ranks that already got the SIGINT:
# a repeat this soon is the same request, not an impatient user.
ESCALATE_AFTER_S = 2.0

_requested = threading.Event()
_node_leaving = threading.Event()
_signals_mean_node_leaving = False
_reason: list[str] = []
_armed = 0
_early = False  # until the first loop ends: a signal before it is armed is kept, not fatal
_first_signal_at: float | None = None
_previous: dict[int, Any] = {}


def request(reason: str, node_leaving: bool = False) -> None:
    if node_leaving:
        _node_leaving.set()
    if not _requested.is_set():
        _reason.append(reason)
        _requested.set()


def requested() -> bool:
    return _requested.is_set()


def node_leaving() -> bool:
    """Whether this process's node is going away (as opposed to the whole run being stopped)."""
    return _node_leaving.is_set()


# The launcher's request to hand over to a larger group: checkpoint, then wait for the restart.
GROWING = "more workers fit"
_growing = threading.Event()


def request_growth() -> None:
    _growing.set()
    request(GROWING)


def growing() -> bool:
    return _growing.is_set()


def signals_mean_node_leaving(flag: bool) -> None:
    """Whether a signal to this process means its node is leaving: a Ray worker of a run that
    restarts its group (the driver's own stop reaches it through the launcher, not a signal)."""
    global _signals_mean_node_leaving
    _signals_mean_node_leaving = flag


# The launcher's notice that this process may not have acted on yet (see `explain_with`).
_explain: list[Callable[[], str | None]] = []


def explain_with(notice: Callable[[], str | None]) -> None:
    """`notice()`: why this process's group is being stopped, as far as the launcher knows (Ray's
    drain notice, which each rank reads by polling: another rank may ask first). Names the cause of
    a stop that this process did not ask for itself."""
    _explain[:] = [notice]


def reason() -> str | None:
    if _reason:
        return _reason[0]
    return next((text for notice in _explain if (text := notice())), None)


@contextlib.contextmanager
def armed() -> Iterator[None]:
    """While inside, signals ask for a graceful stop instead of taking the previous action."""
    global _armed, _early
    _armed += 1
    try:
        yield
    finally:
        _armed -= 1
        _early = False  # the loop is over: a signal now means what it meant before install()


def _handler(signum: int, frame: Any) -> None:
    global _first_signal_at
    now = time.monotonic()
    if (_armed or _early) and (_first_signal_at is None or now - _first_signal_at < ESCALATE_AFTER_S):
        if _first_signal_at is None:
            _first_signal_at = now
            name = signal.Signals(signum).name
            then = "going on without this node" if _signals_mean_node_leaving else "stopping"
            sys.stderr.write(
                f"raylane: {name}: checkpointing at the next step, then {then} "
                f"(send it again after {ESCALATE_AFTER_S:.0f} s to stop at once)\n"
            )
            request(name, node_leaving=_signals_mean_node_leaving)
        return
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif signum == signal.SIGINT or previous is None:
        raise KeyboardInterrupt(signal.Signals(signum).name)
    else:  # SIG_DFL / SIG_IGN for SIGTERM: behave as if we had never been installed
        signal.signal(signum, previous)
        signal.raise_signal(signum)


def install(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT), *, early: bool = False) -> None:
    """Main thread only. Idempotent: the handler that was there first stays the fallback.
    `early`: from now until the first loop ends, a signal is a request even before the loop is
    armed. For a Ray worker: a spot reclaim's SIGTERM can come while its group is still building
    the pipeline or loading the checkpoint (seconds on a busy node), and Ray's own handler would
    end the worker there, which an elastic run takes for a failure of the whole group."""
    global _early
    _early = _early or early
    for signum in signals:
        current = signal.getsignal(signum)
        if current is not _handler:
            _previous[signum] = current
            signal.signal(signum, _handler)
