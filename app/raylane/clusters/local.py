"""`raylane up` / `raylane down`: a persistent, token-authenticated Ray head on this machine.

Every `raylane train`, `tune` and `bench` run on this machine that names no cluster joins it, so
`ray.init`'s process start-up (GCS, raylet, dashboard: several seconds of CPU on a small machine)
is paid once rather than per run. Ray itself is not imported here: the head is `ray start --head
--block` in a session of its own, recorded in `$RAYLANE_HOME/cluster.json` (default
`~/.raylane`), and stopped by that session's process ids, never by `ray stop`, which would stop
every Ray on the machine."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from raylane.clusters.addresses import listening, split_host_port
from raylane.paths import home

STATE_FILE = "cluster.json"
START_TIMEOUT_S = 120.0
STOP_GRACE_S = 5.0
KILL_WAIT_S = 10.0  # after SIGKILL, for the kernel to end what it killed
# What an embedded cluster sets for its own run (see raylane.onray.cluster), set once here for the
# head's processes: Ray Train's controller reads them where it runs, not on the driver. A head on
# one machine is never preempted and nobody scrapes its metrics.
HEAD_ENV = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    # Ray Train gives its controller this one unless set: set here, the controller needs no
    # runtime_env of its own and can start on a warm worker (raylane.onray.warm).
    "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0",
}
# Warm workers (issue 52): the raylet starts job-less Python workers before any run and has each
# import these (through raylane.onray.preload: a worker started for a job imports none), so that a run's Train controller, ranks, sync actor and event sink start on a
# process that is ready (a fresh one each: Ray never gives one job's process to another). Nothing
# here may touch CUDA: the process learns its GPU (CUDA_VISIBLE_DEVICES) only once an actor lands.
WARM_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",  # DDP's constructor imports it (~3 s on 2 cores)
    "ray.train.torch",
    "raylane.onray.launch",
    "raylane.loop.run",
)
WARM_PRELOAD_HOOK = "raylane.onray.preload"  # what Ray's preload imports in every worker
# The variables Ray Train hands its controller and workers come under these names (ray.train's
# ENV_VARS_TO_PROPAGATE): the record keeps what the head set of them, and nothing else (no token).
TRAIN_ENV_PREFIXES = ("RAY_TRAIN_", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "TORCHFT_LIGHTHOUSE", "NCCL_RAS_ADDR")
WARM_EXTRA = 3  # beside the ranks: Ray Train's controller and sync actor, raylane's event sink
WARM_MAX_RANKS = 8  # a pool bigger than this costs memory (each idle worker holds torch) for few runs


@dataclass
class LocalCluster:
    """The head `raylane up` started, as recorded in `$RAYLANE_HOME/cluster.json`."""

    address: str  # the GCS address runs join
    dashboard_url: str  # the jobs API (`raylane submit --address`)
    pid: int  # `ray start --block`, leader of the session holding every process of the cluster
    temp_dir: str
    num_cpus: int
    started_unix: float
    log: str
    warm: int = 0  # the warm workers the head keeps idle (0: none, a head of before issue 52)
    env: dict[str, str] = field(default_factory=dict)  # what the head's processes (and workers) have set
    code: str = ""  # raylane's code the warm workers imported (code_stamp), "" without warm workers
    raylet: str = ""  # the raylet's gRPC address (host:port), where the warm pool is refilled


def running() -> LocalCluster | None:
    """The cluster `raylane up` started, if it is still alive; a stale record is ignored."""
    try:
        cluster = LocalCluster(**json.loads((home() / STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    host, port = split_host_port(cluster.address)
    return cluster if psutil.pid_exists(cluster.pid) and host and listening(host, port) else None


def resolve_address(address: str | None) -> str | None:
    """The cluster a run joins: `address` (or RAY_ADDRESS), else the head `raylane up` started on
    this machine, else None for a fresh embedded cluster. "local" asks for an embedded one even
    when a `raylane up` head is running (the bench's cold start-ups).

    Call it before Ray is imported: joining the head turns on token authentication, a mode Ray
    reads once, at import."""
    address = address or os.environ.get("RAY_ADDRESS")
    if address == "local":
        return None
    if address:
        return address
    cluster = running()
    if cluster is None:
        return None
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    logging.getLogger("raylane").info(
        "joining the local Ray head at %s (`raylane up`; `raylane down` stops it)", cluster.address
    )
    return cluster.address


def warm_pool(num_cpus: int, num_gpus: int = 0) -> int:
    """Warm workers for a head of `num_cpus` logical CPUs and `num_gpus` GPUs: the largest run's
    actors (one rank per GPU, else per CPU, at most WARM_MAX_RANKS) and WARM_EXTRA beside them."""
    return min(num_gpus or num_cpus, WARM_MAX_RANKS) + WARM_EXTRA


def warm_env(pool: int, num_cpus: int) -> dict[str, str]:
    """The raylet's settings for `pool` warm workers ({} for none). Every job-less Python worker
    it starts imports WARM_PRELOAD (raylane.onray.preload). The pool itself is started through the raylet's PrestartWorkers, by `up`
    and after each run (raylane.onray.warmpool): Ray's own prestart starts one worker per logical CPU
    (too many on a big node), and its start for the first driver binds them to that driver's job
    and holds the driver until they are up. Idle workers beyond the soft limit are killed: the
    limit leaves room for the pool beside a run that holds every CPU."""
    if pool <= 0:
        return {}
    return {
        "RAY_enable_worker_prestart": "0",
        "RAY_prestart_worker_first_driver": "0",
        "RAY_preload_python_modules": WARM_PRELOAD_HOOK,
        "RAY_num_workers_soft_limit": str(pool + num_cpus),
    }


def head_path() -> str:
    """The head's PATH: this interpreter's folder first. A job's entrypoint (`raylane submit`'s
    `raylane train ...`, or a user's `ray job submit -- raylane train ...`) runs in the head's
    environment: started as `.venv/bin/raylane up` from a shell where the venv is not activated,
    the job found no `raylane` ("/bin/sh: 1: raylane: not found") or another install's."""
    here = str(Path(sys.executable).parent)
    rest = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != here]
    return os.pathsep.join([here, *rest])


def code_stamp(folder: Path | None = None) -> str:
    """Which raylane code a new Python process on this machine imports (`folder`: raylane's own):
    its folder and its newest source's modification time. Warm workers that imported another are
    recycled (raylane.onray.warmpool)."""
    folder = folder or Path(__file__).resolve().parents[1]
    newest = max((p.stat().st_mtime_ns for p in folder.rglob("*.py")), default=0)
    return f"{folder}@{newest}"


def up(
    num_cpus: int, port: int | None = None, dashboard_port: int | None = None, warm: int | None = None
) -> tuple[LocalCluster, bool]:
    """Start the head unless one is running; returns (cluster, started_now). `warm`: the warm
    workers it keeps (None: warm_pool's size for its CPUs; 0: none). Raises RuntimeError with the
    head's log tail if it does not come up."""
    existing = running()
    if existing:
        return existing, False
    state = home()
    state.mkdir(parents=True, exist_ok=True)
    # The marks an earlier head's warm workers left (raylane.onray.warmpool): by process id, which a
    # new worker may be given again.
    shutil.rmtree(state / "warm", ignore_errors=True)
    gcs_port, dash_port, raylet_port = port or _free_port(), dashboard_port or _free_port(), _free_port()
    # Ray's unix socket paths are length-limited: a short temp dir of its own under /tmp.
    temp = tempfile.mkdtemp(prefix="raylane-", dir="/tmp")
    log_path = state / "head.log"
    # The placement-group cleaner's State API calls name the head's dashboard: with no address they
    # look for "the" Ray on this machine and fail beside any other cluster (see cluster.init_ray).
    pool = warm_pool(num_cpus) if warm is None else max(warm, 0)
    env = {
        **os.environ,
        **HEAD_ENV,
        **warm_env(pool, num_cpus),
        "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dash_port}",
        "PATH": head_path(),
    }
    env.pop("RAY_ADDRESS", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _head_argv(num_cpus, gcs_port, dash_port, temp, raylet_port),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    cluster = LocalCluster(
        address=f"127.0.0.1:{gcs_port}",
        dashboard_url=f"http://127.0.0.1:{dash_port}",
        pid=proc.pid,
        temp_dir=temp,
        num_cpus=num_cpus,
        started_unix=time.time(),
        log=str(log_path),
        warm=pool,
        env={k: v for k, v in env.items() if k.startswith(TRAIN_ENV_PREFIXES)},
        code=code_stamp() if pool else "",
        raylet=f"127.0.0.1:{raylet_port}",
    )
    _wait_started(proc, log_path)
    tmp = state / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(cluster), indent=2) + "\n")
    os.replace(tmp, state / STATE_FILE)
    return cluster, True


def _head_argv(num_cpus: int, gcs_port: int, dash_port: int, temp: str, raylet_port: int) -> list[str]:
    """`ray start --head --block` on this machine's loopback, with ports of its own."""
    return [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs_port}",
        f"--node-manager-port={raylet_port}",  # known here: the warm pool is refilled there
        f"--num-cpus={num_cpus}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash_port}",
        f"--temp-dir={temp}",
        "--disable-usage-stats",
        # Ray's fixed default ports (dashboard agent 52365, client server 10001, ...) would
        # keep any other cluster on this machine, an embedded run's or a test's, from starting
        # its own: "No available agent to submit job". Free ones, so that they coexist.
        *(
            f"--{flag}={_free_port()}"
            for flag in (
                "dashboard-agent-listen-port",
                "dashboard-agent-grpc-port",
                "ray-client-server-port",
                "runtime-env-agent-port",
                "metrics-export-port",
            )
        ),
    ]


def _wait_started(proc: subprocess.Popen, log_path: Path) -> None:
    """Until the head's log says it started; a head that exits first, or takes longer than
    START_TIMEOUT_S, is stopped and its log's tail raised."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Ray runtime started" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_session(proc.pid)
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"the Ray head did not start (log {log_path}):\n{tail}")
        time.sleep(0.2)


def record_code(stamp: str) -> None:
    """The raylane code the head's warm workers now import (raylane.onray.warmpool recycled the older)."""
    path = home() / STATE_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    record["code"] = stamp
    tmp = path.with_name(STATE_FILE + ".code.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)


def down() -> LocalCluster | None:
    """Stop the cluster `raylane up` started (every process of its session), forget it, and
    return it; None when none is running."""
    cluster = running()
    path = home() / STATE_FILE
    if cluster is not None:
        stop_session(cluster.pid)
        _remove_temp_dir(cluster.temp_dir)
    path.unlink(missing_ok=True)
    return cluster


def _remove_temp_dir(temp: str) -> None:
    """The head's own temporary folder (`up` made it): Ray's session files, the jobs' copies of
    their working directories, spilled objects. Nobody's results are there (a job records where
    its submitter looks: raylane.onray.jobs), and it would stay under a random name for good."""
    folder = Path(temp)
    if folder.parent == Path("/tmp") and folder.name.startswith("raylane-"):  # only what up made
        shutil.rmtree(folder, ignore_errors=True)


def stop_session(sid: int, first: tuple[signal.Signals, float] = (signal.SIGTERM, STOP_GRACE_S)) -> None:
    """SIGTERM (or `first`'s signal) every process of the head's session (Ray's daemons, its
    workers, the leftovers of drivers' jobs: Ray keeps them all in the session `ray start`
    opened), then SIGKILL what is still there after a grace period, and wait until they are gone:
    a killed process takes a moment to exit (on a busy machine, `down` returned while a daemon
    still ran). raylane.onray.slurm's nodes stop the same way, their SIGTERM held off."""
    for signum, grace in (first, (signal.SIGKILL, KILL_WAIT_S)):
        for pid in session_pids(sid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.1)


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (a head's: Ray's daemons and workers). A zombie has
    exited; only its parent (or an init that reaps orphans) can remove it. psutil has no session
    id: os.getsid asks the kernel for each process, and only the session's are read further."""
    pids = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == sid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                pids.append(pid)
        except (OSError, psutil.Error):  # gone meanwhile
            continue
    return pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
