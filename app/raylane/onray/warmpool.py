"""A `raylane up` head's warm pool (issue 52), from the head's side: which of its workers are warm
(`pool_workers`: ready, importing, starting), the marks behind that (each worker's, and each run's
while it starts), the top-up that keeps the pool whole (`python -m raylane.onray.warmpool`, through
the raylet's PrestartWorkers: raylane.onray.raylet), and its status file, which `raylane up` reads
(`describe`). A run's own use of the pool is raylane.onray.warm.

How the pool fills (`top_up`), on a head that is never quiet (a shared machine): whatever else the
machine runs, a batch of half its cores (at least one) at a time, each once the last one's imports
are done (a worker marks itself ready: raylane.onray.preload), at the priority of every other
process; deferring only while one of raylane's own runs on this head is starting (its driver's
mark: raylane.onray.warm.joined); no more than the memory holds; for at most TOP_UP_S. Its status
file says what it has and, when short, why (`describe`: `raylane up`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from raylane.clusters import local
from raylane.onray import raylet
from raylane.paths import home

log = logging.getLogger("raylane")

IDLE_TITLE = "ray::IDLE"  # an idle Python worker's process title
STARTING_MARK = "default_worker.py"  # in a worker's command line until it registers (and retitles)
# One top-up's budget: a pool that is not whole by then stops growing, and says so, until the
# next run's end (or `raylane up`) starts another. Seven workers took ~2 min on 2 busy cores.
TOP_UP_S = 600.0
# A run whose driver joined this long ago is no longer starting: past it, the pool fills beside
# the run's training (its start-up took 20-40 s on 2 busy cores).
RUN_STARTING_S = 90.0
WORKER_BYTES = 500 * 1024**2  # an idle warm worker: 440 MB RSS measured (docs/benchmarks.md, E2)
SPARE_BYTES = 1024**3  # memory the pool leaves to everything else
BATCH_SETTLE_S = 0.5
SETTLE_S = 60.0  # for a batch's workers to mark themselves (seconds; a worker that died never does)
POLL_S = 0.5
STATUS_FILE = "warm.json"
IMPORTING = "importing"  # a pool worker's mark while it imports; then "" (ready) or its error


def idle_workers(sid: int, starting: bool = False) -> list[int]:
    """The idle Python workers in the head's session (the head runs on this machine), the pool's
    or not (a job's task worker between tasks is idle too); with `starting`, also those still
    starting (not yet registered with the raylet: the pool's, or a run's cold actors')."""
    ready, importing, launching, others = _workers(sid)
    return sorted(ready + importing + others + (launching if starting else []))


def pool_workers(sid: int) -> tuple[list[int], list[int], list[int]]:
    """The head's warm pool: (ready, importing, starting). Ready and importing are idle workers
    that marked themselves (raylane.onray.preload: a job-less worker); starting are those not yet
    registered, whose job no one can tell from outside (a run's cold actors start so too)."""
    ready, importing, launching, _ = _workers(sid)
    return ready, importing, launching


def _workers(sid: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """The Python workers of session `sid`: (ready, importing, starting, other idle)."""
    ready: list[int] = []
    importing: list[int] = []
    launching: list[int] = []
    others: list[int] = []
    marks = _folder("ready")
    for pid in local.session_pids(sid):
        with contextlib.suppress(psutil.Error):
            cmdline = psutil.Process(pid).cmdline()
            # A starting worker is `python [flags] .../default_worker.py ...` (the raylet's own
            # command line names that script further on). A registered one is retitled.
            if any(arg.endswith(STARTING_MARK) for arg in cmdline[:4]):
                launching.append(pid)
            elif cmdline and cmdline[0].startswith(IDLE_TITLE):
                try:
                    mark = (marks / str(pid)).read_text()
                except OSError:
                    others.append(pid)
                    continue
                (importing if mark == IMPORTING else ready).append(pid)
    return ready, importing, launching, others


def ready_workers(sid: int) -> list[int]:
    """The head's idle warm workers whose imports are done (raylane.onray.preload marked them)."""
    return pool_workers(sid)[0]


def mark(state: str) -> None:
    """In a warm worker: IMPORTING as it starts its imports; "" once they are done, or the error
    that stopped them. The pool counts ready workers, not started ones."""
    with contextlib.suppress(OSError):
        marks = _folder("ready")
        marks.mkdir(parents=True, exist_ok=True)
        tmp = marks / f".{os.getpid()}"
        tmp.write_text(state)
        os.replace(tmp, marks / str(os.getpid()))


def _folder(kind: str) -> Path:
    return home() / "warm" / kind


def mark_run(pid: int) -> None:
    """A run's driver `pid` joined the head and starts: the top-up waits for it (`runs_starting`)."""
    with contextlib.suppress(OSError):
        runs = _folder("runs")
        runs.mkdir(parents=True, exist_ok=True)
        (runs / str(pid)).touch()


def unmark_run(pid: int) -> None:
    """The run of driver `pid` ended: the top-up need not wait for it."""
    with contextlib.suppress(OSError):
        (_folder("runs") / str(pid)).unlink()


def runs_starting(now: float | None = None) -> list[int]:
    """The drivers of runs on this head that joined it within RUN_STARTING_S and are still alive;
    the marks of the others are removed."""
    now = time.time() if now is None else now
    found = []
    for mark in _folder("runs").glob("*") if _folder("runs").is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            if now - mark.stat().st_mtime < RUN_STARTING_S and psutil.pid_exists(int(mark.name)):
                found.append(int(mark.name))
                continue
            mark.unlink()
    return found


def recycle(sid: int, pids: list[int]) -> None:
    """End idle warm workers (they imported raylane code that changed since): the raylet forgets
    a worker that exits, and the refill starts new ones."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    log.debug("recycled %d warm workers of the head (session %d)", len(pids), sid)


def spawn_top_up() -> bool:
    """`python -m raylane.onray.warmpool`: the top-up of the head this machine's RAYLANE_HOME records,
    in a session of its own (it outlives its starter, and no signal to the starter reaches it)."""
    try:
        subprocess.Popen(
            [sys.executable, "-m", "raylane.onray.warmpool"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        log.debug("could not start the warm pool's top-up: %s", exc)
        return False
    return True


def fill(head: local.LocalCluster) -> None:
    """A head `raylane up` just started: its pool, filled in the background."""
    if head.warm > 0 and head.raylet:
        spawn_top_up()


def top_up(head: local.LocalCluster, budget_s: float = TOP_UP_S) -> int:
    """Bring the head's pool to `head.warm` ready workers (fewer where the memory would not hold
    them); returns how many were asked for. Stale ones (older raylane code) are recycled first.
    The raylet starts at most min(cores, CPUs) workers at a time and drops the rest of a request,
    so this asks in batches of half the cores, each once the last one's workers have imported
    (one at a time on 2 cores: ~6 s of CPU each), whatever else keeps the machine busy; only a
    raylane run starting on this head (`runs_starting`) makes it wait: its actors get the CPU.
    Bounded by `budget_s`; the status file says how far it got, and why it stopped short."""
    stamp = local.code_stamp()
    if stamp != head.code:
        recycle(head.pid, sum(pool_workers(head.pid)[:2], []))
        local.record_code(stamp)
    _forget_gone()
    batch_size = max(1, min((os.cpu_count() or 1) // 2, head.num_cpus, raylet.PRESTART_MAX))
    asked, deadline = 0, time.monotonic() + budget_s
    expected, settled_by = 0, 0.0  # the marked workers a batch should make, and until when to wait
    while True:
        ready, importing, starting = pool_workers(head.pid)
        pool = len(ready) + len(importing) + len(starting)
        # A worker that registered but has not marked itself yet (it imports raylane first) is in
        # none of the lists: a batch asked for counts as in the pool until its workers marked.
        in_flight = expected - len(ready) - len(importing) if time.monotonic() < settled_by else 0
        pool += max(in_flight - len(starting), 0)
        wanted, why = pool_size(head.warm, pool)
        if failed := next((e for e in _marks(ready) if e), ""):
            wanted, why = pool, f"the warm workers' imports failed ({failed[:200]})"
        filled = len(ready) >= wanted
        if filled or time.monotonic() > deadline:
            if not filled:
                why = f"{len(ready)} of {wanted} ready after {budget_s:g} s; the next run's end asks again"
            write_status(head, len(ready), pool - len(ready), why, done=True)
            return asked
        write_status(head, len(ready), pool - len(ready), why)
        if importing or starting or in_flight > 0 or pool >= wanted or runs_starting():
            time.sleep(POLL_S)  # imports under way, or a run of raylane's starting: its turn
            continue
        batch = min(wanted - pool, batch_size)
        raylet.prestart(head.raylet, batch)
        asked += batch
        expected, settled_by = len(ready) + batch, time.monotonic() + SETTLE_S
        time.sleep(BATCH_SETTLE_S)  # until they show (the raylet forks them)


def pool_size(size: int, have: int) -> tuple[int, str | None]:
    """How many warm workers the pool can hold beside `have` it has: `size`, or fewer where this
    machine's available memory would not hold them with SPARE_BYTES left (and why)."""
    room = max(int((psutil.virtual_memory().available - SPARE_BYTES) // WORKER_BYTES), 0)
    if have + room >= size:
        return size, None
    available = psutil.virtual_memory().available / 1024**3
    return have + room, (
        f"the memory holds {have + room} of {size}: {available:.1f} GiB available, each worker ~0.5 GiB"
    )


def _forget_gone() -> None:
    """The marks of workers that have exited (an actor took each, or it was recycled)."""
    folder = _folder("ready")
    for path in folder.iterdir() if folder.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            if not psutil.pid_exists(int(path.name.lstrip("."))):
                path.unlink()


def _marks(pids: list[int]) -> list[str]:
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            found.append((_folder("ready") / str(pid)).read_text())
    return found


def write_status(head: local.LocalCluster, ready: int, starting: int, why: str | None, done: bool = False) -> None:
    """What the pool has, for `describe`: written whole (a reader never sees half of it)."""
    record = {"head": head.pid, "size": head.warm, "ready": ready, "starting": starting, "why": why, "done": done}
    with contextlib.suppress(OSError):
        path = home() / STATUS_FILE
        tmp = path.with_name(f"{STATUS_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**record, "unix": time.time()}) + "\n")
        os.replace(tmp, path)


def status(head: local.LocalCluster | None = None) -> dict[str, Any]:
    """The last top-up's status for `head` (the running one by default); {} when none was written."""
    head = head or local.running()
    try:
        record = json.loads((home() / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if head is not None and record.get("head") == head.pid else {}


def describe(head: local.LocalCluster, started: bool, asked: bool = False) -> str:
    """What `raylane up` says of the pool: "N warm workers starting" on a head it just started;
    else how many are ready now, how many still start, and why the pool is short, if it is.
    `asked`: the command asked for warm workers (a head running without them cannot have any)."""
    if head.warm <= 0:
        if asked and not started:
            return "no warm workers: it was started without --warm (`raylane down`, then `raylane up --warm`)"
        return "no warm workers"
    if started:
        return f"{head.warm} warm workers starting (`raylane up` again says how many are ready)"
    ready, importing, starting = (len(w) for w in pool_workers(head.pid))
    line = f"{ready} of {head.warm} warm workers ready"
    if importing + starting:
        line += f", {importing + starting} starting"
    why = status(head).get("why")
    return f"{line}: {why}" if why and ready < head.warm else line


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) `pid` has used; 0 for a process that is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


def main() -> int:
    import fcntl

    logging.basicConfig(level=logging.WARNING)
    head = local.running()
    if head is None or head.warm <= 0 or not head.raylet:
        return 0
    lock = open(home() / "warm.lock", "w")  # noqa: SIM115 - held until this process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another top-up is under way: it fills the pool to its size
    try:
        top_up(head)
    except Exception as exc:  # noqa: BLE001 - a Ray without the call, a refused token: runs start cold
        log.warning("the warm pool of the head at %s could not be refilled: %s", head.address, exc)
        why = f"the head's raylet refused to start warm workers ({type(exc).__name__}: {str(exc)[:200]})"
        write_status(head, len(ready_workers(head.pid)), 0, why, done=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
