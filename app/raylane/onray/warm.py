"""A run on a `raylane up` head with warm workers (issue 52): whether its actors can start on
them, the start-up line that says so, the environment its actors need not carry, and the pool's
refill at its end. The pool itself (which workers are warm, the top-up, its status) is
raylane.onray.warmpool.

The head's raylet keeps job-less Python workers that already imported torch, Ray Train and
raylane's loop (raylane.clusters.local.WARM_PRELOAD). Ray hands one to a new job's actor only when
that actor's runtime_env is empty (a worker's runtime_env is fixed when it starts), so the Train
controller and the ranks get none where the variables Ray Train would give them are already in
the cluster's environment (raylane.onray.trainers). Each actor still gets a process of its own
that has never trained, and it dies with the actor, as on the cold path. Nothing in Ray refills
the pool: the driver starts the head's top-up when its run ends (`refill`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from raylane.clusters import local
from raylane.onray import warmpool


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
    warmpool.mark_run(os.getpid())
    ready, importing, starting = warmpool.pool_workers(head.pid)
    cold = None
    if runtime_env:
        # Every actor of the job inherits it, and a warm worker started with none.
        cold = "the run carries a runtime_env (a pipeline of your own ships with it, or a fault drill's variables)"
    elif head.code != local.code_stamp():
        warmpool.recycle(head.pid, ready + importing)
        ready = []
        cold = "raylane's code changed since the warm workers started: they are recycled, and refilled after this run"
    elif not ready:
        why = warmpool.status().get("why") or "still importing, or taken by the last run and not yet refilled"
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


def refill() -> bool:
    """At a run's end, before the driver leaves: its starting mark goes, and the head's top-up
    starts (warmpool.top_up, in a process of its own that outlives this one, so that the driver's exit
    does not wait for it). Returns whether it was started; never raises: a pool not refilled only
    makes the next run colder."""
    warmpool.unmark_run(os.getpid())
    pool = _joined
    if pool is None or pool.cluster.warm <= 0 or not pool.cluster.raylet:
        return False
    return warmpool.spawn_top_up()
