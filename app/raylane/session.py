"""One launch's lifecycle, whichever kind of launch it is: a training run (raylane.driver), a sweep
and each of its trials (raylane.onray.tune), a search (raylane.autotuning.driver).

Each takes the lease on its folder, opens its MLflow run, closes that run exactly once on every
way out with the one status mapping below (`status_of`: nothing raised is FINISHED, an error
FAILED, an interrupt KILLED; a torchrun rank's, when one of several failed: `TorchrunEnding`),
turns SIGTERM into the same interrupt as Ctrl-C, and says a failure in one line (`failure_text`).
Ray-free: starting Ray is raylane.onray.cluster.start_ray's. Naming the run and taking its lease is
the driver's (raylane.driver.finalize_run, with RunSession.lease)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from raylane.config import BaseConfig
from raylane.errors import TrainingError
from raylane.results import Status
from raylane.runrecord import closing_status

if TYPE_CHECKING:
    from raylane.tracking.runs import RunHandle

log = logging.getLogger("raylane")

T = TypeVar("T")

INTERRUPTED = "interrupted"  # the error of a launch a signal ended


def status_of(exc: BaseException | None) -> Status:
    """The status a launch ends with, from what ended it: FINISHED when nothing was raised, FAILED
    for an error, KILLED for an interrupt (Ctrl-C; SIGTERM, raised as KeyboardInterrupt here;
    Ray's SystemExit)."""
    if exc is None:
        return Status.FINISHED
    return Status.FAILED if isinstance(exc, Exception) else Status.KILLED


def ran(preempted: bool) -> Status:
    """The status of a run that returned: KILLED when a signal or a notice stopped it gracefully
    (checkpointed, to resume), else FINISHED."""
    return Status.KILLED if preempted else Status.FINISHED


def outcome(exc: BaseException) -> tuple[Status, str]:
    """(status, the one line the summary shows) for a launch that `exc` ended: `status_of`'s, and
    `failure_text` for an error."""
    return status_of(exc), failure_text(exc) if isinstance(exc, Exception) else INTERRUPTED


def failure_text(exc: Exception) -> str:
    """The one line a failed launch's summary shows; the whole traceback goes to the library log
    (on Ray, the ranks' tracebacks were logged as they arrived: raylane.onray.launch)."""
    from raylane.errors import ConfigError, DataError, TrainingError
    from raylane.logs import record_traceback
    from raylane.pipelines_ref import UserCodeError

    if isinstance(exc, TrainingError):
        return str(exc)
    record_traceback("the run failed:", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    from raylane.loop.observe.hangs import HangError

    if isinstance(
        exc, (UserCodeError, DataError, HangError, ConfigError)
    ):  # complete as they are: the function, data or field, and the place
        return str(exc)
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0]}" + (" (the rest in the library log)" if len(lines) > 1 else "")


def _first_line(exc: Exception) -> str:
    """An error that left a launch uncaught, in one line for its MLflow run's tag (its traceback
    goes wherever the launch's caller sends it)."""
    from raylane.errors import RaylaneError

    lines = str(exc).strip().splitlines() or [""]
    return lines[0] if isinstance(exc, RaylaneError) else f"{type(exc).__name__}: {lines[0]}"


class SignalInterrupt(KeyboardInterrupt):
    """The KeyboardInterrupt a SIGTERM turns into (`raise_interrupt`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def raise_interrupt(signum: int, frame: Any) -> None:
    """A signal handler: SIGTERM ends a launch as Ctrl-C does, through its `except`s and `finally`s."""
    _catch_swallowed_interrupts()
    raise SignalInterrupt(signum)


def _catch_swallowed_interrupts() -> None:
    """Python runs a signal handler at the next safe point of the main thread, which may be inside
    a garbage collector's or a weakref's callback: what the handler raises there is printed
    ("Exception ignored in ...") and dropped, and the launch never hears of its SIGTERM (seen: a
    sweep that trained on until it was killed). Such an interrupt is sent again, from a thread a
    moment later (sent from the hook itself, it would run at once, still inside the callback), for
    as long as the handler is still in place."""
    previous = sys.unraisablehook
    if getattr(previous, "_raylane_redelivers", False):
        return

    def redeliver(unraisable: Any) -> None:
        exc = unraisable.exc_value
        if isinstance(exc, SignalInterrupt) and signal.getsignal(exc.signum) is raise_interrupt:
            resend = threading.Timer(0.05, os.kill, (os.getpid(), exc.signum))
            resend.daemon = True
            with contextlib.suppress(RuntimeError):  # no new thread while the interpreter exits
                resend.start()
            return
        previous(unraisable)

    redeliver._raylane_redelivers = True  # type: ignore[attr-defined]
    sys.unraisablehook = redeliver


@contextlib.contextmanager
def interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread while inside, as Ctrl-C does, so that a
    launch's session closes its MLflow run: a cluster joined from a thread
    (raylane.onray.cluster.join) installs no handler of Ray's, and the default one ends the process
    on the spot. (An embedded cluster's ray.init replaces it with Ray's, whose SystemExit does the
    same.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class RunSession:
    """One launch, from its lease to its MLflow run's close: a training run's, a sweep's parent
    run, a trial's child run, a search's parent run. Used as a context manager: every way out of
    the block closes the MLflow run exactly once, with the status given to `close` or else the one
    `status_of` gives for how the block ended (KILLED or FAILED when a signal or an error cuts the
    launch short: while Ray starts, or while the end-of-run records, seconds of them, are
    written), then runs what `defer` and `enter` registered (Ray's shutdown, a pool, ...), latest
    first: the lease, taken first, is given back last.

    A run opened on a pool (`open_on`) overlaps with the launch's start; if it is still
    being opened at the close, the thread opening it closes it once it is open, so that a second
    signal cannot keep it from being closed. `closing` maps the status a run is closed with
    (`closes_as_run`: a training run recorded FINISHED stays FINISHED)."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self.closing: Callable[[Status], Status] = lambda status: status
        self._run: Future[RunHandle] | None = None
        self.closed = False
        self.status: Status | None = None  # the status the MLflow run was closed with
        self.folder: Path | None = None  # a training run's folder (finalize_run), where its records go

    def closes_as_run(self, cfg: BaseConfig) -> None:
        """The MLflow run is the training run `cfg` names, in `folder`: one recorded FINISHED
        stays FINISHED whatever this launch did (raylane.runrecord.closing_status)."""
        self.closing = lambda status: closing_status(self.folder, cfg.run.name, Status(status))

    # -- the lease --------------------------------------------------------------------------

    def lease(self, folder: Path | None, what: str, field: str, value: str, fresh: Callable[[], str]) -> None:
        """One writer per folder, held until the session ends (raylane.lease); ConfigError naming
        the holder when another launch holds it. None: a folder on object storage, not leased."""
        from raylane.lease import acquire

        if folder is not None:
            self._stack.callback(acquire(folder, what, field, value, fresh).release)

    # -- the MLflow run ---------------------------------------------------------------------

    def open(self, opener: Callable[..., RunHandle], *args: Any) -> RunHandle:
        """Open the launch's MLflow run with `opener(*args)`, here: what opening it raises, the
        launch raises."""
        handle = opener(*args)
        self.track(handle)
        return handle

    def open_on(self, pool: Executor, opener: Callable[..., RunHandle], *args: Any) -> None:
        """Open the launch's MLflow run with `opener(*args)` on `pool`, while the launch starts;
        `handle` waits for it. Its imports (MLflow's) run beside the launch's own (Ray's), and
        one that fails only because of the other (`import_race`) is tried once more."""
        self._run = pool.submit(_opened, opener, *args)

    def track(self, handle: RunHandle) -> None:
        """Close `handle`, a run opened elsewhere (a trial's child run), as this session's."""
        future: Future[RunHandle] = Future()
        future.set_result(handle)
        self._run = future

    def handle(self) -> RunHandle | None:
        """The open MLflow run, or None: none was opened, or (with a warning) the tracking server
        could not be reached: a launch does not wait for tracking."""
        if self._run is None:
            return None
        try:
            return self._run.result()
        except Exception as exc:  # noqa: BLE001
            # MLflow's message runs to several hundred characters of retries and URLs: the cause is its errno's.
            errno = re.search(r"\[Errno -?\d+\] ([^\"')]+)", str(exc))
            cause = errno.group(1).strip() if errno else f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            from raylane.tracking.runs import resolve_tracking_uri

            log.warning("MLflow at %s cannot be reached (%s): training without tracking", resolve_tracking_uri(), cause)
            return None

    def close(self, status: Status, error: str | None = None) -> None:
        """Close the MLflow run with `status` (the first call only); `error`, the one line the
        launch ended with, is the run's `raylane.error` tag unless it closes FINISHED."""
        if self.closed or self._run is None:
            return
        from raylane.tracking.runs import close_run

        self.closed = True
        self.status = final = self.closing(Status(status))
        said = error if final != Status.FINISHED else None

        def closed_once_open(opened: Future[RunHandle]) -> None:
            if opened.exception() is None:  # else there is no run: tracking was unreachable
                close_run(opened.result(), final, said)

        self._run.add_done_callback(closed_once_open)

    # -- the rest of the way out --------------------------------------------------------------

    def defer(self, callback: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Call `callback` on the way out, after the MLflow run's close, before the lease's."""
        self._stack.callback(callback, *args, **kwargs)

    def enter(self, context: contextlib.AbstractContextManager[T]) -> T:
        """Enter `context` for the rest of the session; it is exited as `defer`'s callbacks are."""
        return self._stack.enter_context(context)

    def __enter__(self) -> RunSession:  # noqa: PYI034 - never subclassed
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if exc is not None:
            self.close(status_of(exc), _first_line(exc) if isinstance(exc, Exception) else INTERRUPTED)
        self._stack.__exit__(kind, exc, tb)
        return False  # what ended the launch goes on up


# The launch's two threads import their heavy libraries one at a time: the opener's MLflow and
# the main thread's Ray share dozens of dependencies, and Python breaks a cycle between two
# threads' imports by handing one of them a half-imported module. Imports hold the GIL anyway,
# so taking turns costs nothing; what overlaps is what waits (the tracking server, Ray's start).
HEAVY_IMPORTS = threading.Lock()
OPENER_IMPORTS = ("mlflow", "mlflow.entities", "mlflow.tracking")


def import_exclusively(*modules: str) -> None:
    """Import `modules` while no other launch thread imports its own (HEAVY_IMPORTS)."""
    import importlib

    with HEAVY_IMPORTS:
        for name in modules:
            importlib.import_module(name)


def _opened(opener: Callable[..., RunHandle], *args: Any) -> RunHandle:
    """`opener(*args)` after MLflow's imports (taking turns with the main thread's, see
    HEAVY_IMPORTS); once more when the first try still lost an import race (`import_race`, to a
    module imported lazily later): what it left of MLflow half-imported is forgotten first (a
    second import would find the package it re-runs without the submodules the first had bound
    to it)."""
    before = set(sys.modules)
    try:
        import_exclusively(*OPENER_IMPORTS)
        return opener(*args)
    except Exception as exc:
        if not import_race(exc):
            raise
        from raylane.logs import record_traceback

        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        record_traceback("opening the MLflow run lost an import race; trying once more:", text)
        for name in [m for m in list(sys.modules) if m not in before and m.split(".")[0] == "mlflow"]:
            sys.modules.pop(name, None)
        return opener(*args)


def import_race(exc: BaseException) -> bool:
    """Whether `exc` is an import that failed because another thread was importing the same
    modules: Python breaks a deadlock between two threads' imports by raising its _DeadlockError
    in one, or by handing it a module still half-imported ("partially initialized module"). The
    opener's MLflow and the main thread's Ray share dozens of dependencies (requests, urllib3,
    asyncio, pandas, pyarrow, ...); seen once in about twelve full test runs: no MLflow run at all.
    Such an import succeeds when tried again, once the half-imported modules are forgotten."""
    text = str(exc)
    return (
        type(exc).__name__ == "_DeadlockError" or "partially initialized module" in text or "deadlock detected" in text
    )


FIND: Literal["find"] = "find"  # finalize_run's `folder` for a launch that has not found it yet


def not_started(session: RunSession, exc: BaseException) -> None:
    """Ray could not be started or joined, or a signal came while the launch waited for it. An
    interrupt ends the launch KILLED, as one during training does, with one line; anything else
    is raised again (FAILED)."""
    status = status_of(exc)
    session.close(status, _first_line(exc) if isinstance(exc, Exception) else INTERRUPTED)
    if status != Status.KILLED:
        raise exc
    print("raylane: interrupted while waiting for the Ray cluster; nothing was trained", file=sys.stderr, flush=True)


class TorchrunEnding:
    """How one torchrun rank's run ends when a rank fails (one of several ranks; the design:
    docs/reliability.md, "A rank's failure under torchrun"). A rank whose own error ended its run
    records it for rank 0 (raylane.loop.observe.rankfailures.publish); rank 0, whose run ended in an echo
    of another rank's failure (a peer gone) or in torchrun's SIGTERM, says the first recorded error
    instead, FAILED, with the failed ranks' logs. Installed, it holds SIGTERM: once a rank failed,
    torchrun's SIGTERM is no stop request (no checkpoint can be agreed with a rank gone) and, once
    the run's end is decided (`over`), not an interrupt either: rank 0 closes its MLflow run and
    writes the summary within torchrun's 30 s before SIGKILL."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.over = False
        self.said: list[Any] = []  # rank 0: the other ranks' RankFailures its line names
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        from raylane.loop.observe import rankfailures

        if self.over:
            return
        if not rankfailures.recorded():  # a stop asked by a person or a scheduler: as before
            previous = self._previous
            (previous if callable(previous) else raise_interrupt)(signum, frame)
            return
        if isinstance(sys.exc_info()[1], Exception):
            return  # this rank's own failure is on its way out, and is said with the others'
        raise_interrupt(signum, frame)  # another rank failed: stop now, no checkpoint to agree on

    def ended(self, exc: BaseException) -> tuple[Status, str]:
        """(status, error line) of a run that `exc`, an error or an interrupt, ended on this rank."""
        return (status_of(exc), self.failed(exc)) if isinstance(exc, Exception) else self.interrupted(exc)

    def failed(self, exc: Exception) -> str:
        """The error line of a run that `exc` ended on this rank."""
        from raylane.logs import log_file
        from raylane.loop.observe import rankfailures
        from raylane.loop.usercode import TRACEBACK_ATTR

        self.over = True
        line = failure_text(exc)  # this rank's traceback into its library log
        echo = rankfailures.is_echo(exc)
        if self.rank != 0:
            if not echo:
                text = getattr(exc, TRACEBACK_ATTR, None) or "".join(traceback.format_exception(exc))
                rankfailures.publish(self.rank, line, text, str(log_file() or "") or None)
            return line
        return (self._others() or line) if echo else line

    def interrupted(self, exc: BaseException) -> tuple[Status, str]:
        """(status, error line) of a run that a signal ended on this rank: FAILED with this rank's
        own error when the signal cut its way out short, or with another rank's (torchrun's SIGTERM
        after that rank failed); else KILLED, interrupted."""
        self.over = True
        context = exc.__context__
        while context is not None and not isinstance(context, Exception):
            context = context.__context__
        if context is not None:
            return status_of(context), self.failed(context)
        if self.rank == 0 and (line := self._others()):
            return outcome(TrainingError(line))  # another rank's failure, as the Ray launcher says one
        return outcome(exc)

    def _others(self) -> str | None:
        """Rank 0: the other ranks' recorded failures in one line (their tracebacks into this
        rank's library log, as a Ray driver's has them), or None when none is recorded."""
        from raylane.logs import record_traceback
        from raylane.loop.observe import rankfailures

        failures = [f for f in rankfailures.recorded(rankfailures.READ_WAIT_S) if f.rank != self.rank]
        if not failures:
            return None
        self.said = rankfailures.said(failures)
        for f in self.said:
            record_traceback(f"training failed on rank {f.rank} ({f.host}):", f.traceback or f.line)
        return rankfailures.first_line(failures)
