"""Warm workers on a `raylane up` head (issue 52): whether a run's actors can start on them, the
start-up line that says so, the pool's refill after each run, and the recycling of workers that
imported older raylane code.

The head's raylet keeps job-less Python workers that already imported torch, Ray Train and
raylane's loop (raylane.clusters.local.WARM_PRELOAD). Ray hands one to a new job's actor only when
that actor's runtime_env is empty (a worker's runtime_env is fixed when it starts), so the Train
controller and the ranks get none where the variables Ray Train would give them are already in
the cluster's environment (raylane.onray.trainers). Each actor still gets a process of its own
that has never trained, and it dies with the actor, as on the cold path. Nothing in Ray refills
the pool: the driver asks the raylet for new workers when its run ends (`refill`).

How the pool fills (`top_up`), on a head that is never quiet (a shared machine): whatever else the
machine runs, a batch of half its cores (at least one) at a time, each once the last one's imports
are done (a worker marks itself ready: raylane.onray.preload), at the priority of every other
process; deferring only while one of raylane's own runs on this head is starting (its driver's
mark, `joined`); no more than the memory holds; for at most TOP_UP_S. Its status file says what
it has and, when short, why (`describe`: `raylane up`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from raylane.clusters import local
from raylane.paths import home

log = logging.getLogger("raylane")

KEEP_ALIVE_S = 24 * 3600  # a refilled worker is not trimmed as idle for this long
PRESTART_TIMEOUT_S = 10.0  # one gRPC call to this machine's raylet
PRESTART_MAX = 10  # the raylet starts at most this many per call (restart_workers_api_max_num_workers)
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


@dataclasses.dataclass
class Pool:
    """The warm pool of the `raylane up` head this driver joined."""

    cluster: local.LocalCluster
    cold: str | None  # why this run's actors start cold; None: they may start warm
    idle: int  # ready warm workers when the run joined


_joined: Pool | None = None


def joined(address: str, runtime_env: Mapping[str, Any]) -> str | None:
    """After ray.init joined `address` with the job's `runtime_env`: the start-up line, which says
    whether this run's actors can start warm and, when not, why; None where there is no pool to
    speak of (another cluster than this machine's `raylane up` head, or a head started without
    `--warm`): every run there starts cold, as it always did, and a line each time would be noise.
    Warm workers that imported older raylane code are recycled here, before the run could land
    on them. The run is marked as starting, so that the pool's top-up waits for it."""
    global _joined
    head = local.running()
    if head is None or head.address != address or head.warm <= 0:
        _joined = None
        return None
    _mark_run(os.getpid())
    ready, importing, starting = pool_workers(head.pid)
    cold = None
    if runtime_env:
        # Every actor of the job inherits it, and a warm worker started with none.
        cold = "the run carries a runtime_env (a pipeline of your own ships with it, or a fault drill's variables)"
    elif head.code != local.code_stamp():
        recycle(head.pid, ready + importing)
        ready = []
        cold = "raylane's code changed since the warm workers started: they are recycled, and refilled after this run"
    elif not ready:
        why = status().get("why") or "still importing, or taken by the last run and not yet refilled"
        cold = f"no warm worker ready on the head ({why})"
    _joined = Pool(head, cold, len(ready))
    if cold:
        return f"starting cold: {cold}"
    more = len(importing) + len(starting)
    return f"warm start: {len(ready)} warm workers ready on the head" + (f", {more} more starting" if more else "")


def joined_pool() -> Pool | None:
    """The warm pool this process's run joined (`joined`), if any."""
    return _joined


def cluster_env() -> Mapping[str, str] | None:
    """What every process of the joined cluster already has set, for the variables a Train
    controller need not carry; None when unknown (an embedded cluster, or one other than
    `raylane up`'s). In a Ray actor (a sweep's trial), its own environment: an actor it creates
    without a runtime_env inherits the trial's, and the node's environment, which together are it."""
    if _in_actor():
        return os.environ
    return _joined.cluster.env if _joined is not None else None


def _in_actor() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def carried(wanted: Mapping[str, str], present: Mapping[str, str] | None) -> dict[str, str]:
    """The variables of `wanted` that a new process still needs: all of them where `present` (the
    environment it would start with) is unknown, else those `present` lacks or sets otherwise."""
    if present is None:
        return dict(wanted)
    return {k: v for k, v in wanted.items() if present.get(k) != v}


def without_inherited(runtime_env: Mapping[str, Any], present: Mapping[str, str]) -> dict[str, Any]:
    """`runtime_env` less the env_vars that `present` (the creating process's own environment, which
    its child actors inherit) already sets alike; {} when nothing else is left."""
    env = dict(runtime_env)
    left = carried(env.pop("env_vars", None) or {}, present)
    return {**env, "env_vars": left} if left else env


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


def _mark_run(pid: int) -> None:
    with contextlib.suppress(OSError):
        runs = _folder("runs")
        runs.mkdir(parents=True, exist_ok=True)
        (runs / str(pid)).touch()


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


def refill() -> bool:
    """At a run's end, before the driver leaves: its starting mark goes, and the head's top-up
    starts (`top_up`, in a process of its own that outlives this one, so that the driver's exit
    does not wait for it). Returns whether it was started; never raises: a pool not refilled only
    makes the next run colder."""
    with contextlib.suppress(OSError):
        (_folder("runs") / str(os.getpid())).unlink()
    pool = _joined
    if pool is None or pool.cluster.warm <= 0 or not pool.cluster.raylet:
        return False
    return spawn_top_up()


def spawn_top_up() -> bool:
    """`python -m raylane.onray.warm`: the top-up of the head this machine's RAYLANE_HOME records,
    in a session of its own (it outlives its starter, and no signal to the starter reaches it)."""
    try:
        subprocess.Popen(
            [sys.executable, "-m", "raylane.onray.warm"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        log.debug("could not start the warm pool's top-up: %s", exc)
        return False
    return True


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
    batch_size = max(1, min((os.cpu_count() or 1) // 2, head.num_cpus, PRESTART_MAX))
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
        prestart(head.raylet, batch)
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


def prestart(raylet: str, num: int) -> None:
    """The PrestartWorkers call of the raylet at `raylet` (host:port): `num` job-less Python workers
    with an empty runtime_env, kept from the idle killer for KEEP_ALIVE_S; they start in the
    background. Token auth: the head has it on, so the call carries the cluster's token (Ray's own
    interceptor; RAY_AUTH_MODE is read at Ray's import)."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import grpc

    from raylane.onray.internals import AuthInterceptor, node_manager_grpc, node_manager_pb2, ray_common_pb2

    with grpc.intercept_channel(grpc.insecure_channel(raylet), AuthInterceptor()) as channel:
        request = node_manager_pb2.PrestartWorkersRequest(
            language=ray_common_pb2.PYTHON, num_workers=num, keep_alive_duration_secs=KEEP_ALIVE_S
        )
        node_manager_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=PRESTART_TIMEOUT_S)


def fill(head: local.LocalCluster) -> None:
    """A head `raylane up` just started: its pool, filled in the background."""
    if head.warm > 0 and head.raylet:
        spawn_top_up()


if __name__ == "__main__":
    sys.exit(main())
