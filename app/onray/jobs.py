"""`raylane submit` and `app.submit(...)`: run `raylane train` as a Ray job on a cluster, through
Ray's Jobs SDK (the counterpart of a cloud training estimator's `fit()`).

The config is validated here first, so bad input fails on the laptop with exit 2, not on the
cluster. This checkout is the job's working directory, minus local state."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from raylane.config import load_config
from raylane.prechecks import check_run

# Uploaded with every job: never the virtualenv, local runs, MLflow stores or test output.
EXCLUDES = [".venv", ".git", "runs", "mlflow.db", "mlruns", "mlartifacts", "mlflow-server", "test-artifacts",
            "**/__pycache__", "*.pyc"]
EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 130}
_RUN_ID = re.compile(r"MLflow run id:\s+([0-9a-f]{32})")


@dataclass
class SubmittedRun:
    """A submitted training job: its status, logs and the MLflow run it records into."""

    job_id: str
    address: str
    _client: Any = field(repr=False, default=None)

    def status(self) -> str:
        return str(self._client.get_job_status(self.job_id).value)

    def logs(self) -> str:
        return self._client.get_job_logs(self.job_id)

    def follow(self) -> Iterator[str]:
        """Log chunks as they come, until the job ends."""
        stream = self._client.tail_job_logs(self.job_id)
        loop = asyncio.new_event_loop()
        try:
            while True:
                try:
                    yield loop.run_until_complete(stream.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            loop.close()

    def wait(self, timeout_s: float = float("inf"), poll_s: float = 1.0) -> str:
        deadline = time.monotonic() + timeout_s
        while (status := self.status()) not in EXIT_CODES and time.monotonic() < deadline:
            time.sleep(poll_s)
        return status

    def mlflow_run_id(self) -> str | None:
        """The run id the job's driver printed (None until it has)."""
        found = _RUN_ID.findall(self.logs())
        return found[-1] if found else None

    def stop(self) -> None:
        self._client.stop_job(self.job_id)  # SIGTERM to the driver: a graceful, resumable stop


# How long a submit waits for a head's job agent to register ("No available agent").
AGENT_WAIT_S = 60.0


def job_client(address: str | None):
    # The jobs API wants the cluster's token; Ray reads the mode once, so before importing it.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    from ray.job_submission import JobSubmissionClient

    from raylane.onray import localcluster

    local = localcluster.running()
    return JobSubmissionClient(address or os.environ.get("RAY_ADDRESS") or (local.dashboard_url if local else None)
                               or "http://127.0.0.1:8265")


def submit(config: str, overrides: Iterable[str] = (), *, address: str | None = None, working_dir: str = ".",
           env_vars: dict[str, str] | None = None) -> SubmittedRun:
    """Validate `config` with `overrides` here, then submit `raylane train` as a Ray job.
    MLFLOW_TRACKING_URI is passed on when set here (point it at the cluster's server)."""
    overrides = list(overrides)
    # ConfigError before anything leaves this machine; run.storage_path is the cluster's to check.
    check_run(load_config(config, overrides), local_storage=False)
    entrypoint = shlex.join(["raylane", "train", config, *[x for o in overrides for x in ("--set", o)]])
    env = {k: v for k, v in os.environ.items() if k == "MLFLOW_TRACKING_URI"}
    env.update(env_vars or {})
    client = job_client(address)
    runtime_env = {"working_dir": working_dir, "excludes": EXCLUDES, "env_vars": env}
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
            break
        except RuntimeError as exc:
            # A head that has just started answers before its job agent has registered.
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    return SubmittedRun(job_id, client.get_address(), client)
