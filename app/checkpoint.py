"""Checkpoints with torch.distributed.checkpoint: every rank writes its own shard, rank 0 the
metadata, so the same code serves DDP now and FSDP later, and loads at another world size.

A checkpoint directory holds the DCP files plus `train_state.json` (epoch, step, position in the
epoch, the resolved config, raylane's version), written by rank 0 after every shard is on disk:
a directory without it is incomplete and never loaded."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

# A single process without a process group is a supported DCP mode, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

TRAIN_STATE_FILE = "train_state.json"
CHECKPOINT_PREFIX = "checkpoint_"


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:09d}"


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any], *, is_rank_zero: bool) -> None:
    """Collective: every rank calls it with its own `path` (the same one on shared storage)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    if is_rank_zero:
        tmp = Path(path) / (TRAIN_STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(train_state, indent=2, sort_keys=True))
        os.replace(tmp, Path(path) / TRAIN_STATE_FILE)  # the commit marker appears atomically


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective. Loads in place (resharding if the world size changed); returns the train state.

    DCP's `.metadata` is a pickle: only load checkpoints this project wrote (trusted storage)."""
    state_file = Path(path) / TRAIN_STATE_FILE
    if not state_file.exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {TRAIN_STATE_FILE})")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads(state_file.read_text())


def latest_committed(root: str, filesystem=None) -> str | None:
    """Newest complete checkpoint directly under `root`, on any pyarrow filesystem (local, S3).

    Our own commit marker decides, not a launcher's bookkeeping: a launcher killed just after a
    checkpoint was written may never have recorded it."""
    import pyarrow.fs as pafs

    fs = filesystem or pafs.LocalFileSystem()
    entries = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    dirs = sorted(e.path for e in entries
                  if e.type == pafs.FileType.Directory and e.base_name.startswith(CHECKPOINT_PREFIX))
    for path in reversed(dirs):
        if fs.get_file_info(f"{path}/{TRAIN_STATE_FILE}").type == pafs.FileType.File:
            return path
    return None
