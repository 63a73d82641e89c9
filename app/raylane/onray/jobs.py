"""`raylane submit` and `app.submit(...)`: run `raylane train` as a Ray job on a cluster, through
Ray's Jobs SDK (the counterpart of a cloud training estimator's `fit()`).

The config is validated first (raylane.api.submit and its preparation, prepare_submit), so bad input fails on
the laptop with exit 2, not on the cluster. This checkout is the job's working directory, minus local state. That directory is a
temporary copy on the cluster: the MLflow tracking URI and run.storage_path are resolved here, on
the submitter's machine, so that the run and its checkpoints land where the submitter looks."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raylane.clusters.addresses import JOIN_TIMEOUT_S, jobs_url, on_this_machine, unreachable, version_mismatch
from raylane.config import BaseConfig, ConfigError
from raylane.errors import RaylaneError
from raylane.prechecks import NoAnswer, within, writable_dir
from raylane.results import JOB_STATUSES, Status, SubmitSummary
from raylane.tracking.runs import DEFAULT_TRACKING_URI, absolute_tracking_uri, local_store

# Uploaded with every job: never the virtualenv, local runs, MLflow stores or test output.
EXCLUDES = [
    ".venv",
    ".git",
    "runs",
    "mlflow.db",
    "mlruns",
    "mlartifacts",
    "mlflow-server",
    "test-artifacts",
    "**/__pycache__",
    "*.pyc",
]
_RUN_ID = re.compile(r"MLflow run id:\s+([0-9a-f]{32})")


@dataclass
class SubmittedRun:
    """A submitted training job: its status, logs and the MLflow run it records into."""

    job_id: str
    address: str
    _client: Any = field(repr=False, default=None)
    tracking_uri: str | None = None  # where the job records its MLflow run (None: MLflow off)
    experiment: str | None = None
    storage_path: str | None = None  # the run's checkpoints: storage_path/run_name
    run_name: str | None = None  # None: named by the job's driver when it starts

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
        while (status := self.status()) not in JOB_STATUSES and time.monotonic() < deadline:
            time.sleep(poll_s)
        return status

    def summary(self, job_status: str | None, error: str | None = None) -> SubmitSummary:
        """The job's end as `raylane submit --follow` reports it (`job_status` None: it was lost)."""
        status = JOB_STATUSES.get(job_status or "", Status.FAILED)
        if error is None and status != Status.FINISHED:
            error = f"job {self.job_id} ended {job_status}: its log above (or `ray job logs {self.job_id}`) says why"
        return SubmitSummary(
            status=status,
            error=error,
            job_id=self.job_id,
            address=self.address,
            job_status=job_status,
            run_id=self.mlflow_run_id() if job_status else None,
            run_name=self.run_name,
            tracking_uri=self.tracking_uri,
            experiment=self.experiment,
            storage_path=self.storage_path,
        )

    def mlflow_run_id(self) -> str | None:
        """The run id the job's driver printed (None until it has)."""
        found = _RUN_ID.findall(self.logs())
        return found[-1] if found else None

    def stop(self) -> None:
        self._client.stop_job(self.job_id)  # SIGTERM to the driver: a graceful, resumable stop


# How long a submit waits for a head's job agent to register ("No available agent").
AGENT_WAIT_S = 60.0
DEFAULT_ADDRESS = "http://127.0.0.1:8265"  # Ray's


class SubmitError(RaylaneError, RuntimeError):
    """The job could not be submitted, for a reason other than the user's input; one line."""


@dataclass(frozen=True)
class JobTarget:
    """The jobs API a submit goes to (`job_target`): the address, what named it (the option or
    variable a mistake names), its URL, host and port, and whether it is on this machine."""

    address: str
    given: str
    url: str
    host: str
    port: int
    here: bool


def job_target(address: str | None) -> JobTarget:
    """Where a job goes (`--address`, else RAY_ADDRESS, else `raylane up`'s, else Ray's default),
    without asking it anything yet: ConfigError for an address that is no jobs API URL or a host
    that does not resolve. Known first, because it decides how the config is checked: a cluster
    on this machine runs the job with this machine's paths (raylane.api.prepare_submit)."""
    address, given = _address(address)
    url, host, port = jobs_url(address, given)
    return JobTarget(address, given, url, host, port, _here(host, given, address))


def submit(
    config: str,
    cfg: BaseConfig,
    target: JobTarget,
    overrides: Iterable[str] = (),
    *,
    working_dir: str = ".",
    env_vars: dict[str, str] | None = None,
) -> SubmittedRun:
    """Submit `raylane train config` with `overrides` as a Ray job to `target`; `cfg` is that
    config, loaded and checked once on this machine (raylane.api.prepare_submit, for a cluster
    `target.here` or not: raylane.api.submit calls both). The job records where the submitter
    looks: its MLflow tracking URI (MLFLOW_TRACKING_URI, from `env_vars` or this environment;
    MLflow's default sqlite:///mlflow.db) and `run.storage_path`, resolved here. For a cluster on
    this machine, relative paths become absolute ones of this machine; a remote cluster needs a
    tracking server and remote or shared storage (ConfigError otherwise). An address that does not
    answer, or a refused token: ConfigError; any other failure to submit: SubmitError. Each with
    a one-line message."""
    overrides = list(overrides)
    config = str(config)
    env = {k: v for k, v in os.environ.items() if k == "MLFLOW_TRACKING_URI"}
    env.update(env_vars or {})
    tracking_uri, storage = destinations(cfg, target.url, target.here, env.get("MLFLOW_TRACKING_URI"))
    if tracking_uri:
        env["MLFLOW_TRACKING_URI"] = tracking_uri
    if target.here:
        # The job reads the config file as written, in its temporary working directory: this
        # machine's paths go with it as `--set`s.
        overrides.extend(_paths_here(cfg, storage))
    if why := unreachable(target.host, target.port, "Ray jobs API"):
        raise ConfigError(
            f"{target.given} = {target.address!r}: {why}; check the address (`raylane up` prints its dashboard) "
            "and that the cluster is up"
        )
    config = config_for_job(config, working_dir, target.here)
    entrypoint = shlex.join(["raylane", "train", config, *[x for o in overrides for x in ("--set", o)]])
    client = _same_ray(job_client(target.url, target.given), target.given, target.address)
    job_id = _submit_job(
        client,
        target.given,
        target.url,
        entrypoint,
        {"working_dir": working_dir, "excludes": EXCLUDES, "env_vars": env},
    )
    return SubmittedRun(
        job_id,
        client.get_address(),
        client,
        tracking_uri=tracking_uri,
        experiment=cfg.mlflow.experiment,
        storage_path=storage,
        run_name=cfg.run.name,
    )


def _here(host: str, given: str, address: str) -> bool:
    """Whether the cluster's jobs API is on this machine; ConfigError when its host does not resolve."""
    try:
        return on_this_machine(host)
    except OSError as exc:
        raise ConfigError(
            f"{given} = {address!r}: cannot resolve host {host!r} ({exc.strerror}); check the address"
        ) from None


def _same_ray(client: Any, given: str, address: str) -> Any:
    """`client`, once the cluster's Ray is known to be this one's: a job's driver would run the
    cluster's Ray, not this one's (ConfigError before the job)."""
    from ray import __version__ as here

    # The Jobs SDK keeps the version the server reported (raylane.onray.internals lists it).
    if why := version_mismatch(given, address, getattr(client, "_server_ray_version", None), here):
        raise ConfigError(why)
    return client


def config_for_job(config: str, working_dir: str, here: bool) -> str:
    """The config as the job names it: the job starts in Ray's copy of `working_dir`. A file in
    that folder: its path there; one outside it (`raylane submit ../other/train.yaml`): its
    absolute path on a cluster on this machine, else ConfigError, as the upload would not carry
    it (before, the job failed on the cluster, "no such file"). A shipped pipeline's name: as is."""
    path = Path(config)
    if not path.is_file():
        return config
    folder = Path(working_dir).resolve()
    if path.resolve().is_relative_to(folder):
        return path.resolve().relative_to(folder).as_posix()
    if here:
        return str(path.resolve())
    raise ConfigError(
        f"CONFIG = {config!r}: outside the folder `raylane submit` uploads ({folder}); run it from a "
        "folder that holds the config and the pipeline's files"
    )


def _paths_here(cfg: BaseConfig, storage: str) -> list[str]:
    """For a cluster on this machine: `storage` (`run.storage_path` as `destinations` resolved
    it) and the inputs of `cfg`, resolved as `raylane train` here would and checked there
    (raylane.api.prepare_submit), as absolute `--set`s for the job, whose working directory is
    Ray's temporary copy of this one (and whose upload would carry data that sits inside it)."""
    from raylane.paths import path_keys

    flat = cfg.flat()
    return [f"run.storage_path={storage}"] * ("://" not in storage) + [
        f"{key}={json.dumps(flat[key])}"
        for key, marker in path_keys(type(cfg)).items()
        if marker.must_exist and flat.get(key) is not None
    ]


def _address(address: str | None) -> tuple[str, str]:
    """The jobs API a submit goes to, and what named it: --address, else RAY_ADDRESS,
    else the head `raylane up` started, else Ray's default."""
    from raylane.clusters import local as localcluster

    if address:
        return address, "--address"
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"], "RAY_ADDRESS"
    local = localcluster.running()
    return (local.dashboard_url, "--address (`raylane up`'s)") if local else (DEFAULT_ADDRESS, "--address (default)")


def destinations(cfg: BaseConfig, url: str, on_this_machine: bool, tracking_uri: str | None) -> tuple[str | None, str]:
    """(MLflow tracking URI, run.storage_path) for the job: a job's working directory is a
    temporary copy on the cluster, where a relative path would put the run and its checkpoints.
    For a cluster on this machine, both as `raylane train` here would use them, absolute; for a
    remote one, ConfigError unless they name a server and remote or shared storage. The tracking
    URI is None with MLflow off."""
    storage = cfg.run.storage_path
    uri = tracking_uri or DEFAULT_TRACKING_URI
    if on_this_machine:
        if "://" not in storage:
            storage = str(Path(storage).expanduser().resolve())
            writable_dir("run.storage_path", storage, cfg.run.storage_path)
        return (absolute_tracking_uri(uri) if cfg.mlflow.enabled else None), storage
    where = f"a job on the remote cluster at {url} would"
    if "://" not in storage and not Path(storage).is_absolute():
        raise ConfigError(
            f"run.storage_path = {storage!r}: {where} write its checkpoints inside its temporary "
            "working directory; set run.storage_path to s3://... or an absolute path the cluster shares"
        )
    if cfg.mlflow.enabled and local_store(uri):
        shown = f"{uri!r}" + ("" if tracking_uri else " (MLflow's default)")
        place = "inside its temporary working directory" if absolute_tracking_uri(uri) != uri else "in a file there"
        raise ConfigError(
            f"MLFLOW_TRACKING_URI = {shown}: {where} record its MLflow run {place}; set "
            "MLFLOW_TRACKING_URI to the cluster's MLflow server (http://...), or mlflow.enabled=false"
        )
    return (uri if cfg.mlflow.enabled else None), storage


def job_client(url: str, given: str = "--address"):
    """Ray's Jobs SDK client for `url`: it asks the server's version first, with no time limit of
    its own, so that question is given JOIN_TIMEOUT_S here."""
    # The jobs API wants the cluster's token; Ray reads the mode once, so before importing it.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    from ray.job_submission import JobSubmissionClient

    try:
        return within(lambda: JobSubmissionClient(url), JOIN_TIMEOUT_S, "raylane-jobs-client")
    except NoAnswer:
        raise ConfigError(
            f"{given} = {url!r}: no Ray jobs API answers there within {JOIN_TIMEOUT_S:g} s "
            "(something listens on that port, but does not answer as one)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - each becomes one line
        raise _one_line(exc, given, url) from None


def _submit_job(client: Any, given: str, url: str, entrypoint: str, runtime_env: dict[str, Any]) -> str:
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        except Exception as exc:  # noqa: BLE001 - each becomes one line
            # A head that has just started answers before its job agent has registered.
            if "No available agent" not in str(exc) or time.monotonic() > deadline:
                raise _one_line(exc, given, url) from None
            time.sleep(1.0)


def _one_line(exc: Exception, given: str, url: str) -> Exception:
    """What the Jobs SDK raised, as one line (its whole traceback goes to the library log):
    ConfigError where the user's input is the cause, SubmitError otherwise."""
    from ray.exceptions import AuthenticationError

    logging.getLogger("ray").warning("submitting to %s failed", url, exc_info=exc)  # the log file
    text = str(exc).strip()
    first = (text.splitlines() or [type(exc).__name__])[0][:300]
    shown = f"{given} = {url!r}"
    if isinstance(exc, AuthenticationError):
        if text.startswith("Authentication failed"):
            return ConfigError(
                f"{shown}: the cluster refused this token (HTTP 403); set RAY_AUTH_TOKEN_PATH to a "
                "file holding the cluster's token"
            )
        return ConfigError(
            f"{shown}: the cluster asks for its auth token (HTTP 401); set RAY_AUTH_TOKEN_PATH to a "
            "file holding it (`raylane up` uses ~/.ray/auth_token unless RAY_AUTH_TOKEN_PATH is set)"
        )
    if "Version check returned 404" in text:
        return ConfigError(f"{shown}: something answers there, but not Ray's jobs API (HTTP 404 for /api/version)")
    if isinstance(exc, ConnectionError):
        return ConfigError(f"{shown}: no Ray jobs API answers there ({first})")
    if isinstance(exc, (ValueError, FileNotFoundError)):  # from the runtime environment it was given
        return ConfigError(f"{shown}: the job cannot be submitted: {first}")
    return SubmitError(f"{shown}: the job could not be submitted: {type(exc).__name__}: {first}")
