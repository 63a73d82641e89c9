"""Checkpoints: one package for writing, committing, finding and loading a run's state.

- `state`: what a checkpoint holds of a rank's model and optimizer (their state dicts through
  torch.distributed.checkpoint, DCP), and `rng`: its random generators, as plain JSON.
- `writing`: the files, each fsynced, and the commit; `agree`: the collectives by which every
  rank learns a save's outcome alike; `loading`: back into a model and optimizer, at any world
  size, with `weights_only=True` where a file is a pickle of ours.
- `manifest`: the commit record (`manifest.json`, written last) and its checks, torch-free so
  that the driver's checks before a launch can read it.
- Every layout loads every other's checkpoints (`state`: parameters and the optimizer's state
  keyed by name); the layout a checkpoint was saved at is in its manifest, recorded and read by
  raylane.loop.distributed.layout.Layout, which says the line a resume at another says.
- `staging` and `saving`: the asynchronous save, which copies the state into reused CPU
  buffers and writes it on a thread of its own while training goes on.
- `storage`: where checkpoints live (a local or shared folder, or object storage) and which to keep.

This module holds what the rest of raylane calls; the Trainer saves through `saving.Saver`.
Importing it imports no torch (the driver's checks read manifests): the names of the modules
that need torch load on first use (`_LAZY`)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from raylane.loop.checkpoint.manifest import (
    CHECKPOINT_PREFIX,
    MANIFEST_FILE,
    checkpoint_name,
    committed,
    latest_valid,
    newest_valid,
    prune,
    read_manifest,
    sha256,
    verify,
)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time, __getattr__ below
    from raylane.loop.checkpoint import state
    from raylane.loop.checkpoint.agree import CheckpointSaveError, collectives_on, raise_if_any
    from raylane.loop.checkpoint.loading import CheckpointLoadError, load
    from raylane.loop.checkpoint.rng import rng_file, rng_state
    from raylane.loop.checkpoint.state import STATE_FILE, live_state, model_shapes, replicated
    from raylane.loop.checkpoint.writing import PendingSave, save, write

__all__ = [
    "CHECKPOINT_PREFIX",
    "MANIFEST_FILE",
    "STATE_FILE",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "PendingSave",
    "checkpoint_name",
    "collectives_on",
    "committed",
    "latest_valid",
    "live_state",
    "load",
    "model_shapes",
    "newest_valid",
    "prune",
    "raise_if_any",
    "read_manifest",
    "replicated",
    "rng_file",
    "rng_state",
    "save",
    "sha256",
    "state",
    "verify",
    "write",
]

# Each name that needs torch -> the module of this package it comes from, imported at its first
# use (the same names as the imports for type checkers above: tests/unit/test_checkpoint_names.py).
_LAZY = {
    "CheckpointSaveError": "agree",
    "collectives_on": "agree",
    "raise_if_any": "agree",
    "CheckpointLoadError": "loading",
    "load": "loading",
    "rng_file": "rng",
    "rng_state": "rng",
    "STATE_FILE": "state",
    "live_state": "state",
    "model_shapes": "state",
    "replicated": "state",
    "PendingSave": "writing",
    "save": "writing",
    "write": "writing",
}
# Modules of this package that need torch and are part of its public names.
_LAZY_MODULES = {"state"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return import_module(f"{__name__}.{name}")
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
