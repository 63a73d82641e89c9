"""raylane: distributed PyTorch training on Ray (DDP/FSDP workers, Tune sweeps, MLflow tracking).

The public API is what this module exports:

- `Pipeline`, `BaseConfig`, `Section`: what a pipeline module defines (`Config`, `build(cfg)`);
  see docs/pipelines.md. `Hook` and `HookContext`: a pipeline's hooks (raylane.loop.hooks).
- `check`, `train`, `tune`, `submit`, `up` and `down`: the `raylane` commands of those names as
  calls (raylane.api, which also has `autotune` and `export`), checked by the same preparation
  path as the CLI (raylane.prepare).
- `InputPath`, `InputPaths`, `OutputPath`: the types of a pipeline's path-valued config keys,
  which raylane resolves before any worker sees them (raylane.paths).
- `ConfigError`: bad input, with a message that names the field and the value.

Importing raylane imports neither torch nor Ray: the names that need them load on first use.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("raylane")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

from raylane.api import check, down, submit, train, tune, up  # after __version__, which they import
from raylane.config import BaseConfig, ConfigError, Section
from raylane.paths import InputPath, InputPaths, OutputPath

__all__ = ["BaseConfig", "ConfigError", "DataError", "Hook", "HookContext", "InputPath", "InputPaths", "OutputPath",
           "Pipeline", "Section", "__version__", "check", "down", "submit", "train", "tune", "up"]

# Names that import torch, resolved on first access (PEP 562).
_LAZY = {"Pipeline": "raylane.loop.pipeline", "FileSource": "raylane.loop.streaming", "DataError": "raylane.loop.baddata",
         "Hook": "raylane.loop.hooks", "HookContext": "raylane.loop.hooks"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raylane' has no attribute {name!r}")
