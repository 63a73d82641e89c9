"""Checkpoints: one package for writing, committing, finding and loading a run's state.

- `state`: a rank's model, optimizer and RNG state written through torch.distributed.checkpoint
  (DCP) and loaded back with `weights_only=True`; the collectives that agree on a save's outcome.
- `manifest`: the commit record (`manifest.json`, written last) and its checks, torch-free so
  that the driver's checks before a launch can read it.
- `staging` and `saving`: the asynchronous save, which copies the state into reused CPU
  buffers and writes it on a thread of its own while training goes on.
- `storage`: where checkpoints live (a local or shared folder, or object storage) and which to keep.

This module holds what the rest of raylane calls; the Trainer saves through `saving.Saver`.
Importing it imports no torch (the driver's checks read manifests): `state`'s names load on
first use."""

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
    from raylane.loop.checkpoint.state import (
        STATE_FILE,
        CheckpointLoadError,
        CheckpointSaveError,
        PendingSave,
        collectives_on,
        live_state,
        load,
        model_shapes,
        raise_if_any,
        replicated,
        rng_file,
        rng_state,
        save,
        write,
    )

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

_STATE_NAMES = {
    "STATE_FILE",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "PendingSave",
    "collectives_on",
    "live_state",
    "load",
    "model_shapes",
    "raise_if_any",
    "replicated",
    "rng_file",
    "rng_state",
    "save",
    "write",
}


def __getattr__(name: str) -> Any:
    if name == "state" or name in _STATE_NAMES:
        state = import_module("raylane.loop.checkpoint.state")
        return state if name == "state" else getattr(state, name)
    raise AttributeError(f"module 'raylane.loop.checkpoint' has no attribute {name!r}")
