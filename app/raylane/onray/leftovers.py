"""What an embedded Ray cluster leaves when its driver is killed (SIGKILL, the OOM killer), and
the workers of a run whose driver is gone.

An embedded cluster's GCS and raylet die with the driver that started them (Ray's fate sharing),
and its workers about 2 s later; but Ray's dashboard and runtime-env agents, started by the
raylet, were seen to outlive it by 1 to 5 minutes, and in those 2 s the workers wrote 10 more
checkpoints (every 20 steps of a fast run). So:

- a driver that starts an embedded cluster records it in `$RAYLANE_HOME/embedded/` (its pid, the
  process's start time, Ray's session folder) and forgets it when it stops the cluster. The next
  launch on this machine finds a record whose driver is gone and stops, by pid, every process
  that still holds files in that session folder: a process of that cluster, never a reused pid
  (Ray's session folders are unique to a cluster, and are named after no other process);
- a worker checks that its driver is alive before it starts a checkpoint (`DriverWatch`): a
  process check where the worker shares the driver's machine, else a call to an actor the driver
  owns, which Ray ends with its owner. Not a collective: each rank looks for itself, and a rank
  that finds the driver gone raises, so no new checkpoint is committed.

No Ray import here."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from raylane.errors import RaylaneError
from raylane.paths import home

log = logging.getLogger("raylane")

RECORDS = "embedded"
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class ProcessId:
    """A process as it can be told apart from a later one with the same pid: its start time, and
    where the pid means something (the host and its pid namespace)."""

    host: str
    pid_namespace: int
    pid: int
    started_unix: float

    @staticmethod
    def here() -> ProcessId:
        pid = os.getpid()
        return ProcessId(socket.gethostname(), _pid_namespace(), pid, psutil.Process(pid).create_time())

    def comparable(self) -> bool:
        """Its pid can be looked up from this process (the same machine and pid namespace)."""
        return self.host == socket.gethostname() and self.pid_namespace == _pid_namespace()

    def alive(self) -> bool:
        """Only for a comparable one: the process still runs (a pid taken by another process since
        has another start time)."""
        try:
            process = psutil.Process(self.pid)
            return process.status() != psutil.STATUS_ZOMBIE and abs(process.create_time() - self.started_unix) < 1.0
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:  # another user's process: there, so alive
            return True


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (not Linux): the host name alone
        return 0


class DriverGone(RaylaneError, RuntimeError):
    """The run's driver ended without stopping its workers: nothing more is written."""


class DriverWatch:
    """On a Ray worker: whether the run's driver is still alive, asked before each checkpoint."""

    def __init__(self, driver: ProcessId | None, owned_actor=None, timeout_s: float = 10.0) -> None:
        self.driver, self.owned_actor, self.timeout_s = driver, owned_actor, timeout_s

    def gone(self) -> bool:
        if self.driver is not None and self.driver.comparable():
            return not self.driver.alive()
        if self.owned_actor is None:
            return False
        import ray

        try:
            ray.get(self.owned_actor.stop_requested.remote(), timeout=self.timeout_s)
        except ray.exceptions.RayActorError:  # Ray ends the actors a driver owns when it dies
            return True
        except Exception:  # noqa: BLE001 - slow to answer (a busy node) is not gone
            return False
        return False

    def check(self, what: str) -> None:
        if self.gone():
            driver = f"pid {self.driver.pid} on {self.driver.host}" if self.driver else "its driver"
            raise DriverGone(f"the run's driver ({driver}) is gone: {what} is not written, and this worker stops")


# -- the driver's side: its embedded cluster, recorded, and a dead driver's, stopped --------------


def _records() -> Path:
    return home() / RECORDS


def record_embedded(session_dir: str) -> None:
    """This process started an embedded Ray cluster whose files are under `session_dir`."""
    me = ProcessId.here()
    folder = _records()
    with contextlib.suppress(OSError):  # a home we cannot write: nothing is recorded, nothing breaks
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{me.pid}.json.tmp"
        tmp.write_text(json.dumps({**asdict(me), "session_dir": session_dir}))
        os.replace(tmp, folder / f"{me.pid}.json")


def forget_embedded() -> None:
    """This process stopped its embedded cluster."""
    with contextlib.suppress(OSError):
        (_records() / f"{os.getpid()}.json").unlink(missing_ok=True)


def stop_leftovers() -> list[int]:
    """Stop what is left of the embedded clusters of drivers on this machine that are gone,
    with one line for each such cluster; returns the pids stopped."""
    folder = _records()
    try:
        records = sorted(folder.glob("*.json"))
    except OSError:
        return []
    stopped: list[int] = []
    for path in records:
        try:
            record = json.loads(path.read_text())
            owner = ProcessId(**{k: record[k] for k in ("host", "pid_namespace", "pid", "started_unix")})
            session = str(record["session_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours
        if not owner.comparable() or owner.alive():
            continue
        claimed = path.with_name(f"{path.name}.{os.getpid()}.stopping")
        try:
            os.replace(path, claimed)  # of two launches that find it, one stops it
        except OSError:
            continue
        stopped += _stop_cluster(owner, session)
        claimed.unlink(missing_ok=True)
    return stopped


def _stop_cluster(owner: ProcessId, session: str) -> list[int]:
    found = _holding(session, owner.started_unix)
    if not found:
        return []
    names = ", ".join(f"{name} {pid}" for pid, name in sorted(_names(found).items()))
    for process in found:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(found, timeout=STOP_GRACE_S)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(alive, timeout=STOP_GRACE_S)
    log.warning(
        "stopped %d Ray process%s (%s) left by the embedded cluster of pid %d, since %s, which ended without stopping it",
        len(found),
        "" if len(found) == 1 else "es",
        names,
        owner.pid,
        time.strftime("%H:%M:%S", time.localtime(owner.started_unix)),
    )
    return sorted(p.pid for p in found)


def _holding(session: str, not_before: float) -> list[psutil.Process]:
    """Live processes of this user that hold a file in `session` and started after its driver."""
    prefix = session.rstrip("/") + "/"
    found = []
    for process in psutil.process_iter():
        try:
            if (
                process.pid == os.getpid()
                or process.create_time() < not_before - 1.0
                or process.status() == psutil.STATUS_ZOMBIE
            ):
                continue
            if any(f.path.startswith(prefix) for f in process.open_files()):
                found.append(process)
        except psutil.Error:  # gone meanwhile, or another user's
            continue
    return found


def _names(processes: list[psutil.Process]) -> dict[int, str]:
    names = {}
    for process in processes:
        try:
            argv = process.cmdline()
            names[process.pid] = Path(argv[0]).name if argv and argv[0] else process.name()
        except psutil.Error:
            names[process.pid] = "?"
    return names
