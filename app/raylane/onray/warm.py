"""Warm workers on a `raylane up` head (issue 52): whether a run's actors can start on them, the
start-up line that says so, the pool's refill after each run, and the recycling of workers that
imported older raylane code.

The head's raylet keeps job-less Python workers that already imported torch, Ray Train and
raylane's loop (raylane.clusters.local.WARM_PRELOAD). Ray hands one to a new job's actor only when
that actor's runtime_env is empty (a worker's runtime_env is fixed when it starts), so the Train
controller and the ranks get none where the variables Ray Train would give them are already in
the cluster's environment (raylane.onray.trainers). Each actor still gets a process of its own
that has never trained, and it dies with the actor, as on the cold path. Nothing in Ray refills
the pool: the driver asks the raylet for new workers when its run ends (`refill`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raylane.clusters import local

log = logging.getLogger("raylane")

KEEP_ALIVE_S = 24 * 3600  # a refilled worker is not trimmed as idle for this long
PRESTART_TIMEOUT_S = 10.0  # one gRPC call to this machine's raylet
PRESTART_MAX = 10  # the raylet starts at most this many per call (restart_workers_api_max_num_workers)
IDLE_TITLE = b"ray::IDLE"  # an idle Python worker's process title
STARTING_MARK = b"default_worker.py"  # in a worker's command line until it registers (and retitles)
TOP_UP_S = 600.0  # it waits while a run keeps the head busy; the next run's end starts another
BUSY_CORES = 0.5  # the machine busier than this, its pool aside: a run is starting or training
BUSY_WINDOW_S = 0.5
QUIET_S = 3.0
BATCH_SETTLE_S = 0.5
POLL_S = 0.25


@dataclasses.dataclass
class Pool:
    """The warm pool of the `raylane up` head this driver joined."""

    cluster: local.LocalCluster
    cold: str | None  # why this run's actors start cold; None: they may start warm
    idle: int  # idle warm workers when the run joined


_joined: Pool | None = None


def joined(address: str, runtime_env: Mapping[str, Any]) -> str | None:
    """After ray.init joined `address` with the job's `runtime_env`: the start-up line, which says
    whether this run's actors can start warm and, when not, why; None where there is no pool to
    speak of (another cluster than this machine's `raylane up` head, or a head started without
    `--warm`): every run there starts cold, as it always did, and a line each time would be noise.
    Warm workers that imported older raylane code are recycled here, before the run could land
    on them."""
    global _joined
    head = local.running()
    if head is None or head.address != address or head.warm <= 0:
        _joined = None
        return None
    idle = idle_workers(head.pid)
    cold = None
    if runtime_env:
        # Every actor of the job inherits it, and a warm worker started with none.
        cold = "the run carries a runtime_env (a pipeline of your own ships with it, or a fault drill's variables)"
    elif head.code != local.code_stamp():
        recycle(head.pid, idle)
        idle = []
        cold = "raylane's code changed since the warm workers started: they are recycled, and refilled after this run"
    elif not idle:
        cold = "no idle warm worker on the head (the last run's refill may still be starting them)"
    _joined = Pool(head, cold, len(idle))
    if cold:
        return f"starting cold: {cold}"
    return f"warm start: {len(idle)} idle warm workers on the head"


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
    """The idle Python workers in the head's session (the head runs on this machine); with
    `starting`, also those still starting (not yet registered with the raylet)."""
    found = []
    for pid in local.session_pids(sid):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            # A starting worker is `python [flags] .../default_worker.py ...` (the raylet's own
            # command line names that script further on).
            launching = any(arg.endswith(STARTING_MARK) for arg in cmdline.split(b"\0")[:4])
            if cmdline.startswith(IDLE_TITLE) or (starting and launching):
                found.append(pid)
    return found


def recycle(sid: int, pids: list[int]) -> None:
    """End idle warm workers (they imported raylane code that changed since): the raylet forgets
    a worker that exits, and the refill starts new ones."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    log.debug("recycled %d warm workers of the head (session %d)", len(pids), sid)


def refill() -> bool:
    """At a run's end, before the driver leaves: start the head's top-up (`top_up`, in a process of
    its own that outlives this one, so that the driver's exit does not wait for it). Returns
    whether it was started; never raises: a pool not refilled only makes the next run colder."""
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


def top_up(head: local.LocalCluster) -> int:
    """Bring the head's pool to `head.warm` idle workers; returns how many were asked for. Stale
    ones (older raylane code) are recycled first. The raylet starts at most `concurrency` workers
    at a time and drops the rest of a request, so this asks in batches, each once the last one's
    workers registered (~2 s each on 2 cores; their imports go on after that), and only while the
    head's other processes are quiet: a run starting meanwhile (back to back) gets the CPU, and
    its actors the workers ready so far. Bounded: TOP_UP_S."""
    stamp = local.code_stamp()
    if stamp != head.code:
        recycle(head.pid, idle_workers(head.pid))
        local.record_code(stamp)
    concurrency = max(1, min(os.cpu_count() or 1, head.num_cpus))
    asked, deadline, quiet_since = 0, time.monotonic() + TOP_UP_S, time.monotonic()
    while time.monotonic() < deadline:
        pool = idle_workers(head.pid, starting=True)
        missing = head.warm - len(pool)
        if missing <= 0:
            break
        if _busy(head.pid, set(pool)):
            quiet_since = time.monotonic()
        starting = len(pool) - len(idle_workers(head.pid))
        # The last batch registered, and the machine was quiet for QUIET_S: no run is starting (a
        # run started back to back would otherwise share the CPU with the workers' imports).
        if not starting and time.monotonic() - quiet_since >= QUIET_S:
            batch = min(missing, concurrency, PRESTART_MAX)
            prestart(head.raylet, batch)
            asked += batch
            time.sleep(BATCH_SETTLE_S)  # until they show (the raylet forks them)
        time.sleep(POLL_S)
    return asked


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user and system) `pid` has used; 0 for a process that is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _busy(sid: int, pool: set[int]) -> bool:
    """Whether this machine's processes other than the pool's (a driver starting, a run's actors,
    anyone's work) used more than BUSY_CORES over BUSY_WINDOW_S."""
    tick = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        machine = (sum(fields) - fields[3] - fields[4]) / tick  # all but idle and iowait
        return machine - sum(process_cpu_s(pid) for pid in pool)

    before = cpu()
    time.sleep(BUSY_WINDOW_S)
    return cpu() - before > BUSY_CORES * BUSY_WINDOW_S


def main() -> int:
    import fcntl

    logging.basicConfig(level=logging.WARNING)
    head = local.running()
    if head is None or head.warm <= 0 or not head.raylet:
        return 0
    lock = open(local.home() / "warm.lock", "w")  # noqa: SIM115 - held until this process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another top-up is under way: it fills the pool to its size
    try:
        top_up(head)
    except Exception as exc:  # noqa: BLE001 - a Ray without the call, a refused token: runs start cold
        log.warning("the warm pool of the head at %s could not be refilled: %s", head.address, exc)
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
