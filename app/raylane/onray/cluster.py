"""Starting or joining the Ray cluster a run uses, and shutting an embedded one down.

Ray core only: `start_ray` imports Ray Train and torch (`raylane.onray.launch`, ~3.5 s of CPU on 2
cores) on another thread while `init_ray` starts Ray's processes here."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
import time
from concurrent.futures import Executor
from typing import Any

import ray

from raylane import logs, pipelines_ref
from raylane.clusters.addresses import JOIN_TIMEOUT_S, address_field, join_hint, reported_versions, version_mismatch
from raylane.config import BaseConfig, ConfigError
from raylane.onray.placement import check_placeable
from raylane.session import raise_interrupt

log = logging.getLogger("raylane")

# Ray Train polls its workers every 2 s by default, and a run's end waits for that poll. Each poll
# is an RPC into every worker, which on a busy node delays a rank, and its peers wait in the next
# all-reduce: at 0.2 s, B1 measured 2.8 ms a step against 2.5 ms at 1 s (`regression`, 2 ranks on
# 2 cores). The end of a run takes about two polls: last step to exit was 1.0 s at 0.2 s,
# 1.2-1.6 s at 0.5 s and 2.3-2.5 s at 1 s. 0.5 s keeps it under B2's 2 s with fewer interruptions.
TRAIN_ENV_DEFAULTS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}
# An embedded cluster lives and dies with this process on one node: nothing can preempt its node,
# nobody scrapes its metrics, and its placement groups vanish with it. Each of these features
# costs an extra process or RPCs at start-up on a small machine.
EMBEDDED_ENV_DEFAULTS = {
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    # Ray Train gives a worker group 60 s to start, then fails the run. On one
    # busy machine (2 cores, a sweep's trials, another job) two workers
    # importing torch were seen to need longer; no autoscaler is coming.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300",
}
EMBEDDED_OBJECT_STORE_BYTES = 512 * 1024**2
DATA_CPUS = 1.0


def start_ray(
    cfg: BaseConfig,
    address: str | None,
    pool: Executor | None = None,
    startup: Any = None,
    *,
    num_cpus: float = 0,
    dashboard: bool = False,
) -> RayStopper:
    """The one way every launch (train, autotune, a sweep's driver) joins the cluster at `address`
    (as raylane.clusters.local.resolve_address returned it, before Ray's import:
    raylane.api.joined_address) or starts an embedded one (`num_cpus`, `dashboard`: see
    init_ray); returns the RayStopper its caller waits on last (`embedded`: whether this process
    started the cluster, and so stops it). ConfigError, with the cluster stopped, when the
    config's workers fit no node. `pool`: where Ray Train is imported meanwhile, for a launch
    whose driver starts the workers itself; `startup`: the launch's StartupTimes."""
    if pool is not None:
        # Ray Train and torch import (~3.5 s of CPU on 2 cores) while Ray's processes start:
        # ray.init mostly waits for them. launch_on_ray's import joins this one.
        pool.submit(importlib.import_module, "raylane.onray.launch")
    embedded = init_ray(address, cfg, num_cpus, dashboard)
    if startup is not None:
        startup.mark("ray_init")
    if threading.current_thread() is threading.main_thread():
        # ray.init put Ray's own in place of the launch's: its C++ failure handler (over its
        # sys.exit on an embedded cluster) prints a stack and arms a 3 s alarm that aborts the
        # process (exit 134), the MLflow runs left RUNNING. raylane.tune() from a thread: the
        # handler is its caller's.
        signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        check_placeable(cfg, embedded)
    except ConfigError:
        shutdown_ray(embedded)
        raise
    return RayStopper(embedded)


def init_ray(address: str | None, cfg: BaseConfig, num_cpus: float = 0, dashboard: bool = False) -> bool:
    """Join `address` (resolved by raylane.clusters.local.resolve_address before Ray was
    imported) if there is one, else start a fresh embedded cluster
    (with at least `num_cpus` logical CPUs; with `dashboard`, the dashboard on a free loopback
    port, for the State API that Ray Train's placement-group cleaner needs when Tune kills a trial).

    Returns True when this process started the cluster and so must shut it down."""
    for key, value in TRAIN_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    pipelines_ref.register_for_pickling()
    if address:
        # A pipeline of the user's own reaches the cluster's workers with the run; inside a Ray
        # job (the supervisor sets this variable) the job's working_dir already carries it.
        runtime_env = pipelines_ref.joined_runtime_env(in_job="RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ)
        # A fault drill's plan (raylane.loop.observe.faults) is read by the workers: an embedded cluster
        # inherits it from this process, a joined one gets it with the run.
        drill = {k: v for k, v in os.environ.items() if k.startswith("RAYLANE_FAULT")}
        if drill:
            runtime_env = {**runtime_env, "env_vars": {**runtime_env.get("env_vars", {}), **drill}}
        join(
            address,
            logging_level=logging.WARNING,
            log_to_driver=logs.verbose(),
            **({"runtime_env": runtime_env} if runtime_env else {}),
        )
        from raylane.onray import warm

        # The start-up line: warm or cold, and why. The job's runtime_env as Ray holds it: inside a
        # Ray job (`raylane submit`) it is the job's (its working_dir), not only what is passed here.
        job_env = {**(runtime_env or {}), **dict(ray.get_runtime_context().runtime_env or {})}
        if line := warm.joined(address, job_env):
            log.info("%s", line)
        return False
    pipelines_ref.worker_environment()  # the raylet, and so every worker, inherits it
    for key, value in EMBEDDED_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    needed = max(cfg.scaling.num_workers * cfg.scaling.cpus_per_worker + data_cpus(cfg), num_cpus)
    dashboard_port = _free_port() if dashboard else None
    if dashboard:
        # Ray Train's placement-group cleaner finds the State API by looking for "the" Ray on this
        # machine, and fails ("multiple active Ray instances") beside a `raylane up` head or another
        # run's cluster, leaving the trial's resources held. Named here, inherited by every worker.
        os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{dashboard_port}"
    ray.init(
        address="local",  # never attach to a stale cluster by accident
        num_cpus=max(int(needed + 0.999), os.cpu_count() or 1),
        num_gpus=None if cfg.scaling.use_gpu else 0,  # None: Ray detects the GPUs itself
        include_dashboard=dashboard,
        **({"dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port} if dashboard else {}),
        object_store_memory=EMBEDDED_OBJECT_STORE_BYTES,
        logging_level=logging.WARNING,
        # The workers' output reaches this terminal only with --verbose (raylane.logs); said
        # here, not through RAY_LOG_TO_DRIVER, which Ray reads once, at its import, for good.
        log_to_driver=logs.verbose(),
    )
    _record_embedded()
    return True


def _record_embedded() -> None:
    """So that the next launch stops what is left of this cluster, should this process be killed
    without stopping it (raylane.onray.leftovers)."""
    from raylane.onray.internals import ray_worker
    from raylane.onray.leftovers import record_embedded

    node = getattr(ray_worker, "_global_node", None)  # private: checked, with no record as fallback
    session = node.get_session_dir_path() if node is not None else None
    if session:
        record_embedded(session)


# (address, thread) of a join given up on whose ray.init still waits (the Python API's next call).
_given_up: tuple[str, threading.Thread] | None = None


def join(address: str, **init_kwargs) -> None:
    """ray.init(address=...), given up on with a ConfigError when the cluster's GCS has not
    answered within JOIN_TIMEOUT_S (Ray itself retries for minutes). ray.init runs on a thread of
    its own so that this one stays free for SIGTERM and Ctrl-C, which inside ray.init wait for
    Ray's native connect loop, 30 s at a time. Once the GCS has answered, ray.init goes on
    unbounded here: it may be uploading the run's own pipeline."""
    global _given_up
    field = address_field(address)
    if _given_up is not None and _given_up[1].is_alive():
        # ray.init cannot be cancelled: a second one in this process would race the first.
        raise ConfigError(
            f"{field} = {address!r}: this process still waits in ray.init for the cluster at "
            f"{_given_up[0]!r}, given up on earlier; start a new Python process to join a cluster"
        )
    done, failed = threading.Event(), []

    def connect() -> None:
        try:
            ray.init(address=address, **init_kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            failed.append(exc)
        finally:
            done.set()

    restore, thread = _interruptible(), None
    try:
        waited = _wait_for_grpc(address, field)
        # A daemon: a thread left waiting for a cluster that never answers must not keep the process.
        thread = threading.Thread(target=connect, name="raylane-ray-join", daemon=True)
        thread.start()
        if not done.wait(max(JOIN_TIMEOUT_S - waited, 1.0)) and not _gcs_connected():
            _given_up = (address, thread)
            raise _no_answer(field, address)
        done.wait()
    except BaseException:  # Ctrl-C or SIGTERM while ray.init waits: it goes on waiting, abandoned
        if thread is not None:
            _given_up = (address, thread)
        raise
    finally:
        restore()
    if failed:
        exc = failed[0]
        logging.getLogger("ray").warning("joining the Ray cluster at %s failed", address, exc_info=exc)  # the log file
        if not isinstance(exc, Exception):
            raise exc
        if versions := reported_versions(str(exc)):
            raise ConfigError(
                version_mismatch(field, address, versions[0], versions[2], versions[1], versions[3])
            ) from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{field} = {address!r}: cannot join the Ray cluster there: {first[:300]}") from None


def _wait_for_grpc(address: str, field: str) -> float:
    """Wait, at most JOIN_TIMEOUT_S, until `address` speaks gRPC (HTTP/2), as a GCS does; returns
    the seconds waited. Ray's own connect loop holds the interpreter's lock 5 s at a time while it
    retries a peer that accepts and then says nothing (a wrong port, a hung head): every other
    thread of the process, this command's way out after Ctrl-C included, crawls meanwhile. Here
    the wait is grpc's, which holds nothing. Skipped where Ray speaks TLS (the probe has no
    certificates) or through Ray Client (`ray://`)."""
    if address.startswith("ray://") or os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return 0.0
    started = time.monotonic()
    if not gcs_answers(address, JOIN_TIMEOUT_S):
        raise _no_answer(field, address)
    return time.monotonic() - started


def gcs_answers(address: str, timeout_s: float) -> bool:
    """Whether `address` (HOST:PORT) speaks gRPC within `timeout_s`, as a GCS that is up does
    (raylane.onray.slurm's wait asks the same, within its own bound)."""
    import grpc

    channel = grpc.insecure_channel(address)
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        ready.cancel()  # first: its watcher thread fails loudly on a channel closed under it
        channel.close()


def _no_answer(field: str, address: str) -> ConfigError:
    return ConfigError(
        f"{field} = {address!r}: no Ray cluster answers there within {JOIN_TIMEOUT_S:g} s "
        f"(something listens on that port, but not Ray's GCS); {join_hint(field)}"
    )


def _gcs_connected() -> bool:
    # ray.init sets its node (private: Ray's worker module) once the GCS has answered.
    from raylane.onray.internals import ray_worker

    return getattr(ray_worker, "_global_node", None) is not None


def join_abandoned() -> bool:
    """A join given up on (its limit, or Ctrl-C) whose ray.init still waits in Ray's native
    connect loop, holding Ray's global lock: ray.shutdown, and an import that needs a module
    ray.init is importing, would wait for it (minutes)."""
    return _given_up is not None and _given_up[1].is_alive()


def _interruptible():
    """SIGTERM raises KeyboardInterrupt in this thread while it waits for Ray, where nothing else
    (the driver's handler) would turn it into a graceful stop; returns what undoes that."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        return lambda: None
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    return lambda: signal.signal(signal.SIGTERM, previous)


def data_cpus(cfg: BaseConfig) -> float:
    """CPUs a run needs beside its workers: Ray Data's read and map tasks, for a pipeline that
    streams (declares `sources`, see raylane.loop.data.streaming). Without a free CPU they would wait
    forever behind workers that wait for their data."""
    from raylane import pipelines_ref

    return DATA_CPUS if pipelines_ref.resolve(cfg.pipeline).streams else 0


def shutdown_ray(embedded: bool) -> None:
    """ray.shutdown(), less an idle second for an embedded cluster. Ray stops its autoscaler
    monitor last, with SIGTERM, and the monitor spends about 1 s reporting its own termination
    (a traceback on the driver's console) to a GCS that is already gone. An embedded cluster
    never autoscales, so its monitor is killed outright first; the rest stops as Ray does it. A
    joined `raylane up` head gets its warm workers back first (raylane.onray.warm.refill)."""
    if embedded:
        try:
            from raylane.onray.internals import ray_worker

            node = ray_worker._global_node  # private: checked, with a plain shutdown as fallback
            monitors = node.all_processes.get("monitor", []) if node is not None else []
            for info in monitors:
                info.process.kill()
                info.process.wait(5)
        except Exception as exc:  # noqa: BLE001 - a Ray internal moved: shut down the slow way
            log.debug("could not stop Ray's monitor first: %s", exc)
    else:
        from raylane.onray import warm

        warm.refill()  # the warm workers this run took, asked for while Ray is still joined
    ray.shutdown()
    if embedded:
        from raylane.onray.leftovers import forget_embedded

        forget_embedded()


class RayStopper:
    """Shuts Ray down once: in the background as soon as the ranks are done (`start`), so that an
    embedded cluster's ~0.7 s of stopping processes overlaps the end-of-run MLflow records, which
    do not use Ray; `wait` (or a `wait` without `start`, on any early exit) finishes it."""

    def __init__(self, embedded: bool) -> None:
        self.embedded = embedded  # this process started the cluster
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=shutdown_ray, args=(self.embedded,), name="raylane-ray-stop")
            self._thread.start()

    def wait(self) -> None:
        self.start()
        self._thread.join()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
