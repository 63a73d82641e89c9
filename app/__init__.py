"""raylane: distributed PyTorch training on Ray (DDP/FSDP workers, Tune sweeps, MLflow tracking).

The public API is what this module exports:

- `Pipeline`, `BaseConfig`, `Section`: what a pipeline module defines (`Config`, `build(cfg)`);
  see docs/pipelines.md.
- `train(config, overrides=..., address=...) -> summary`, `tune(sweep, ...) -> summary` and
  `submit(config, ...) -> job handle`: the `raylane train`, `tune` and `submit` commands as calls.
- `ConfigError`: bad input, with a message that names the field and the value.

Importing raylane imports neither torch nor Ray: the names that need them load on first use.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from raylane.config import BaseConfig, ConfigError, Section

try:
    __version__ = version("raylane")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["BaseConfig", "ConfigError", "Pipeline", "Section", "__version__", "submit", "train", "tune"]

# Names that import torch, resolved on first access (PEP 562).
_LAZY = {"Pipeline": "raylane.loop.pipeline", "FileSource": "raylane.loop.streaming"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raylane' has no attribute {name!r}")


def train(config, overrides=(), *, address: str | None = None, local: bool = False,
          register: str | None = None) -> dict[str, Any]:
    """Train a pipeline: `raylane train CONFIG --set ...` as a call. `config` is a YAML path, a
    shipped config's name or a mapping. Returns the run's summary (`status`, `metrics`,
    `run_id`, `checkpoint`, ...); raises ConfigError on bad input, before anything starts."""
    from raylane.driver import run_training

    return run_training(config, overrides, address=address, local=local, register=register)


def tune(sweep, overrides=(), *, address: str | None = None, register: str | None = None) -> dict[str, Any]:
    """Run a sweep: `raylane tune SWEEP --set ...` as a call. Returns the sweep's summary (its
    trials and the best one); raises ConfigError on bad input, before Ray starts."""
    from raylane.onray.localcluster import resolve_address

    address = resolve_address(address)  # before Ray's import: see resolve_address
    from raylane.onray.tune import tune_sweep

    return tune_sweep(sweep, overrides, address=address, register=register)


def submit(config, overrides=(), **options):
    """Submit `raylane train CONFIG` as a Ray job; returns a handle with status(), logs(),
    follow(), wait(), stop() and mlflow_run_id(), and where the job records (`tracking_uri`,
    `experiment`, `storage_path`). Raises ConfigError on bad input (the CLI's one line). See
    `raylane.onray.jobs.submit`."""
    from raylane.onray.jobs import submit as _submit

    return _submit(config, overrides, **options)
