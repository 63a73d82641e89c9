"""The one module a warm `raylane up` head has each new Python worker import as it starts (Ray's
`RAY_preload_python_modules`): in a job-less worker, one the pool's refill started
(raylane.onray.warmpool), the warm modules (raylane.clusters.local.WARM_PRELOAD), then a mark that it
is ready (raylane.onray.warmpool.mark: the pool counts ready workers, not started ones); in a
worker the raylet started for a job's task or actor, nothing.

Ray passes the preload list to every Python worker it starts. Handed the warm modules directly, a
sweep's small actors (Tune's trial, Ray Train's sync actor, the event sink, Ray Data's), each
started cold for its job, paid ~5 s of torch's imports it never used: a 4-trial sweep took 119-124 s
on a warm head against 87 s on one without. A worker started for a job cannot become a warm one
(Ray never gives one job's process to another), so only the pool's own workers import."""

from __future__ import annotations

import importlib
import sys

import ray

from raylane.clusters.local import WARM_PRELOAD


def job_less() -> bool:
    """Whether this worker was started for no job: prestarted for the warm pool."""
    # Ray's worker imports the preload list after it connects; imported anywhere else (a test
    # importing every module), asking for the runtime context would start a local Ray.
    if not ray.is_initialized():
        return False
    try:
        return ray.get_runtime_context().get_job_id() == ray.JobID.nil().hex()
    except Exception:  # noqa: BLE001 - not a connected worker (imported elsewhere): nothing to warm
        return False


def warm_up() -> None:
    """The warm modules, then the mark: with the error, where one failed (the worker stays, a
    job-less worker without them; the pool's top-up says why and stops asking for more)."""
    from raylane.onray import warmpool

    warmpool.mark(warmpool.IMPORTING)
    error = ""
    try:
        for name in WARM_PRELOAD:
            importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - recorded for the top-up, which says it in one line
        error = f"{type(exc).__name__}: {exc}"
        print(f"raylane: a warm worker could not import the warm modules: {error}", file=sys.stderr, flush=True)
    warmpool.mark(error)


if job_less():
    warm_up()
