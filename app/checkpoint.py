"""Checkpoints with torch.distributed.checkpoint: every rank writes its own shard, rank 0 the
metadata, so the same code serves DDP now and FSDP later, and loads at another world size.

Each checkpoint is a fresh directory committed by `manifest.json`, written last and atomically by
rank 0. It holds the train state (epoch, step, position in the epoch, the resolved config,
raylane's version) and the size and SHA-256 of every file of every rank. A directory without a
manifest, or whose files do not match it (truncated, bit-flipped, missing), is never loaded:
the newest valid one is used instead."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

# A single process without a process group is a supported DCP mode, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

log = logging.getLogger("raylane.checkpoint")

MANIFEST_FILE = "manifest.json"
CHECKPOINT_PREFIX = "checkpoint_"


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:09d}"


def _sha256(stream) -> str:
    digest = hashlib.sha256()
    while chunk := stream.read(1 << 22):
        digest.update(chunk)
    return digest.hexdigest()


def _digest(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return {"size": path.stat().st_size, "sha256": _sha256(f)}


def rng_file(rank: int) -> str:
    return f"rng_{rank}.json"


def rng_state() -> dict[str, Any]:
    """This rank's random generators (torch, numpy, python) as plain JSON: nothing to unpickle."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_kind, np_keys.tolist(), np_pos, np_has_gauss, np_gauss],
        "python": [py_version, list(py_state), py_gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))


def _own_files(path: Path, rank: int) -> dict[str, dict[str, Any]]:
    """The files this rank wrote into `path` (DCP names data files `__<rank>_<n>.distcp`)."""
    names = [*path.glob(f"__{rank}_*.distcp"), path / rng_file(rank)]
    if rank == 0:
        names.append(path / ".metadata")
    return {p.name: _digest(p) for p in names}


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any], *, rank: int) -> None:
    """Collective: every rank calls it with its own `path` (the same one on shared storage)."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    (path / rng_file(rank)).write_text(json.dumps(rng_state()))
    files = _own_files(path, rank)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[dict[str, Any]] = [{}] * dist.get_world_size()
        dist.all_gather_object(gathered, files)
        files = {name: info for part in gathered for name, info in part.items()}
    if rank == 0:
        manifest = {"train_state": train_state, "files": files}
        tmp = path / (MANIFEST_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / MANIFEST_FILE)  # the commit: appears whole or not at all


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / MANIFEST_FILE).read_text())


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         rank: int | None = None) -> dict[str, Any]:
    """Collective. Loads in place (resharding if the world size changed); returns the train state.
    With `rank`, also restores that rank's random generators when the world size is unchanged.

    DCP's `.metadata` is a pickle: only load checkpoints this project wrote (trusted storage)."""
    if not (Path(path) / MANIFEST_FILE).exists():
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no {MANIFEST_FILE})")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train_state = read_manifest(path)["train_state"]
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rng = Path(path) / rng_file(rank if rank is not None else -1)
    if rank is not None and train_state.get("world_size") == world_size and rng.exists():
        set_rng_state(json.loads(rng.read_text()))
    return train_state


def verify(path: str, fs=None) -> str | None:
    """None if every file matches the manifest, else what is wrong."""
    import pyarrow.fs as pafs

    fs = fs or pafs.LocalFileSystem()
    try:
        with fs.open_input_stream(f"{path}/{MANIFEST_FILE}") as f:
            files = json.loads(f.read())["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"unreadable manifest ({exc.__class__.__name__})"
    for name, want in sorted(files.items()):
        info = fs.get_file_info(f"{path}/{name}")
        if info.type != pafs.FileType.File:
            return f"{name} is missing"
        if info.size != want["size"]:
            return f"{name} has {info.size} bytes, the manifest says {want['size']}"
        with fs.open_input_stream(f"{path}/{name}") as f:
            actual = _sha256(f)
        if actual != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def committed(root: str, filesystem=None) -> list[str]:
    """Directories under `root` with a manifest, oldest first (names sort by step)."""
    import pyarrow.fs as pafs

    fs = filesystem or pafs.LocalFileSystem()
    entries = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    dirs = sorted(e.path for e in entries
                  if e.type == pafs.FileType.Directory and e.base_name.startswith(CHECKPOINT_PREFIX))
    return [d for d in dirs if fs.get_file_info(f"{d}/{MANIFEST_FILE}").type == pafs.FileType.File]


def latest_valid(root: str, filesystem=None) -> str | None:
    """Newest checkpoint under `root` whose files match its manifest, on any pyarrow filesystem.

    Our own manifest decides, not a launcher's bookkeeping: a launcher killed just after a
    checkpoint was written may never have recorded it."""
    for path in reversed(committed(root, filesystem)):
        problem = verify(path, filesystem)
        if problem is None:
            return path
        log.warning("checkpoint %s is corrupt (%s); trying the previous one", path, problem)
    return None


def prune(root: str, keep: int, filesystem=None) -> None:
    """Delete all but the newest `keep` committed checkpoints (rank 0, after a commit)."""
    import pyarrow.fs as pafs

    fs = filesystem or pafs.LocalFileSystem()
    for path in committed(root, fs)[:-keep]:
        fs.delete_dir(path)
