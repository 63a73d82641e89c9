"""One run, one writer: a lease on a run's folder.

Two launches of one `run.name` at once would both resume from the same checkpoint, write the same
checkpoint folder and log into the same MLflow run (every metric twice, two models). The driver
of a run (or sweep, or search) takes the lease before it opens its MLflow run or starts Ray, and
gives it back at its end. The lease is a file in the folder, `raylane_lease.json`, naming its
holder (host, pid, when it started, the command) with a heartbeat the holder renews every
`HEARTBEAT_S`. A second launch finds it and stops with one line naming the holder; a lease whose
holder is gone (its process ended on this host, or no heartbeat for `STALE_S` from another
host sharing the folder) is taken over, with a line saying so.

Taking and renewing happen under an advisory lock (`fcntl.flock`) on a file beside it, so that of
two launches that find the same stale lease only one takes it. Local and shared filesystems
only: object storage (`s3://`) has no such lock, and is not leased."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from raylane.config import ConfigError

log = logging.getLogger("raylane")

LEASE_FILE = "raylane_lease.json"
LOCK_FILE = ".raylane_lease.lock"
LEASE_FILES = frozenset({LEASE_FILE, LOCK_FILE})  # what a lease leaves in a folder
HEARTBEAT_S = 10.0
# Another host's lease is only judged by its heartbeat: a holder that missed this many seconds
# of renewals (HEARTBEAT_S apart) is taken to be gone.
STALE_S = 60.0


@dataclass
class Holder:
    host: str
    pid: int
    started_unix: float  # the holder process's own start (psutil), which a reused pid does not share
    taken_unix: float
    heartbeat_unix: float
    command: str
    token: str

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S", time.localtime(self.taken_unix))
        beat = max(time.time() - self.heartbeat_unix, 0.0)
        return f"pid {self.pid} on {self.host}, since {since}, last heartbeat {beat:.0f} s ago"


class RunLease:
    """A lease held by this process on `folder`; `release()` gives it back (idempotent)."""

    def __init__(self, folder: Path, holder: Holder) -> None:
        self.folder, self.holder = folder, holder
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="raylane-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with _locked(self.folder):
                    current = _read(self.folder)
                    if current is None or current.token != self.holder.token:
                        log.warning(
                            "the lease on %s was taken by %s: this launch no longer holds it",
                            self.folder,
                            current.describe() if current else "nobody",
                        )
                        return
                    self.holder.heartbeat_unix = time.time()
                    _write(self.folder, self.holder)
            except OSError as exc:  # a full disk or a vanished share: the next beat tries again
                log.debug("could not renew the lease on %s: %s", self.folder, exc)

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            with _locked(self.folder):
                current = _read(self.folder)
                if current is not None and current.token == self.holder.token:
                    (self.folder / LEASE_FILE).unlink(missing_ok=True)
        except OSError as exc:
            log.debug("could not release the lease on %s: %s", self.folder, exc)


class NoLease:
    """What a run on object storage holds instead (see the module's note)."""

    def release(self) -> None:
        pass


def acquire(folder: Path, what: str, field: str, value: str, fresh: Callable[[], str]) -> RunLease:
    """The lease on `folder` (made if missing) for `what` ("run 'x'"), or ConfigError naming the
    live holder: `field = value` is what the user set, `fresh()` another value to use instead."""
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    me = Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        started_unix=_process_start(os.getpid()) or now,
        taken_unix=now,
        heartbeat_unix=now,
        command=" ".join(sys.argv)[:300],
        token=uuid.uuid4().hex,
    )
    with _locked(folder):
        current = _read(folder)
        if current is not None and current.token != me.token and _alive(current):
            raise ConfigError(
                f"{field} = {value!r}: {what} is already running ({current.describe()}; "
                f"{current.command!r}); wait for it to end, or start another with --set {field}={fresh()}"
            )
        if current is not None:
            log.warning("%s: took over the lease of %s, which is no longer running", what, current.describe())
        _write(folder, me)
    return RunLease(folder, me)


def _alive(holder: Holder) -> bool:
    if holder.host != socket.gethostname():
        return time.time() - holder.heartbeat_unix < STALE_S
    try:
        started = psutil.Process(holder.pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:  # another user's process: there, so alive
        return True
    # A pid reused by another process since: its start time differs from the holder's.
    return abs(started - holder.started_unix) < 1.0


def _process_start(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """The folder itself is the lock (nothing left behind); where its filesystem cannot lock a
    folder (some network filesystems), a lock file beside the lease."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        fd = os.open(folder / LOCK_FILE, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            os.close(fd)
            raise
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read(folder: Path) -> Holder | None:
    try:
        return Holder(**json.loads((folder / LEASE_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None  # none, or torn by a crash mid-write (writes are atomic, so unlikely): free


def _write(folder: Path, holder: Holder) -> None:
    tmp = folder / f"{LEASE_FILE}.{holder.token}.tmp"
    tmp.write_text(json.dumps(asdict(holder)))
    os.replace(tmp, folder / LEASE_FILE)
