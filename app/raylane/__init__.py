"""raylane: distributed PyTorch training on Ray (DDP/FSDP workers, Tune sweeps, MLflow tracking).

The public API is what this module exports:

- `Pipeline`, `BaseConfig`, `Section`: what a pipeline module defines (`Config`, `build(cfg)`);
  see docs/pipelines.md. `FileSource`: files streamed as a pipeline's data. `StepFn`: the type
  of a pipeline's `step`. `Hook` and `HookContext`: a pipeline's hooks. `DataError`: a bad row.
  `frozen_base(model, path)`: a model trained on a frozen base, whose checkpoints hold only what
  trains (what LoRA's `apply_lora` does).
- `check`, `train`, `tune`, `autotune`, `submit`, `up` and `down`: the `raylane` commands of
  those names as calls (raylane.api, which also has `export`), checked by the same preparation
  path as the CLI (raylane.api: prepare_train, ...).
- `InputPath`, `InputPaths`, `OutputPath`: the types of a pipeline's path-valued config keys,
  which raylane resolves before any worker sees them (raylane.paths).
- `ConfigError`: bad input, with a message that names the field and the value.
- `TrainSummary`, `SweepSummary`, `AutotuneSummary`, `SubmitSummary`, `ExportSummary`, `Status`
  and `read_summary`: what the calls return and `--summary-json` writes, typed and versioned
  (raylane.results; docs/summary.md describes every field).

Importing raylane imports neither torch nor Ray: the names that need them load on first use.
Everything else (raylane.loop, raylane.autotuning, raylane.onray, raylane.tracking and the modules
beside this one) is internal and may change in any release; raylane.hf has its own `__all__`.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from raylane.api import autotune, check, down, submit, train, tune, up
from raylane.config import BaseConfig, ConfigError, Section
from raylane.errors import DataError
from raylane.paths import InputPath, InputPaths, OutputPath
from raylane.results import (
    AutotuneSummary,
    ExportSummary,
    Status,
    SubmitSummary,
    SweepSummary,
    TrainSummary,
    read_summary,
)
from raylane.version import __version__

# tests/unit/test_public_api.py holds this list too: a name that disappears from it fails there.
__all__ = [
    "AutotuneSummary",
    "BaseConfig",
    "ConfigError",
    "DataError",
    "ExportSummary",
    "FileSource",
    "Hook",
    "HookContext",
    "InputPath",
    "InputPaths",
    "OutputPath",
    "Pipeline",
    "Section",
    "Status",
    "StepFn",
    "SubmitSummary",
    "SweepSummary",
    "TrainSummary",
    "__version__",
    "autotune",
    "check",
    "down",
    "frozen_base",
    "read_summary",
    "submit",
    "train",
    "tune",
    "up",
]

# Names that import torch, resolved on first access (PEP 562).
_LAZY = {
    "Pipeline": "raylane.loop.protocols.pipeline",
    "FileSource": "raylane.loop.data.streaming",
    "Hook": "raylane.loop.protocols.hooks",
    "HookContext": "raylane.loop.protocols.hooks",
    "StepFn": "raylane.loop.protocols.pipeline",
    "frozen_base": "raylane.loop.checkpoint.frozen",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raylane' has no attribute {name!r}")
