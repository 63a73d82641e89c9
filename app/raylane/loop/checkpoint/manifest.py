"""A checkpoint's commit record, read without torch: `manifest.json`, written last by rank 0 (see
raylane.loop.checkpoint), lists the size and SHA-256 of every file. A directory without one, or
whose files do not match it, is not a checkpoint. Here: the names, the reading, the checks, and
the listing and pruning of a run's checkpoints on any pyarrow filesystem. The prechecks use it
before torch or Ray is imported."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("raylane.checkpoint")

MANIFEST_FILE = "manifest.json"
CHECKPOINT_PREFIX = "checkpoint_"


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:09d}"


def sha256(stream) -> str:
    digest = hashlib.sha256()
    while chunk := stream.read(1 << 22):
        digest.update(chunk)
    return digest.hexdigest()


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(path) / MANIFEST_FILE).read_text())


def verify(path: str, fs=None, *, checksums: bool = True) -> str | None:
    """None if every file matches the manifest, else what is wrong. Without `checksums`, sizes
    only: what can be checked in milliseconds whatever the model's size."""
    import pyarrow.fs as pafs

    fs = fs or pafs.LocalFileSystem()
    try:
        with fs.open_input_stream(f"{path}/{MANIFEST_FILE}") as f:
            files = dict(json.loads(f.read())["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable manifest ({exc.__class__.__name__})"
    for name, want in sorted(files.items()):
        info = fs.get_file_info(f"{path}/{name}")
        if info.type != pafs.FileType.File:
            return f"{name} is missing"
        want = want if isinstance(want, dict) else {}  # a manifest edited by hand: a mismatch, not a crash
        if info.size != want.get("size"):
            return f"{name} has {info.size} bytes, the manifest says {want.get('size')}"
        if not checksums:
            continue
        with fs.open_input_stream(f"{path}/{name}") as f:
            actual = sha256(f)
        if actual != want.get("sha256"):
            return f"{name} does not match its checksum"
    return None


def _listed(root: str, fs) -> list[tuple[str, bool]]:
    """(directory, whether it has a manifest) of every checkpoint under `root`, oldest first
    (names sort by step)."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem):  # listed after every save: os is ~10x cheaper here
        try:
            names = sorted(e.name for e in os.scandir(root) if e.name.startswith(CHECKPOINT_PREFIX) and e.is_dir())
        except FileNotFoundError:
            return []
        paths = [os.path.join(root, n) for n in names]
        return [(p, os.path.isfile(os.path.join(p, MANIFEST_FILE))) for p in paths]
    entries = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    dirs = sorted(
        e.path for e in entries if e.type == pafs.FileType.Directory and e.base_name.startswith(CHECKPOINT_PREFIX)
    )
    return [(d, fs.get_file_info(f"{d}/{MANIFEST_FILE}").type == pafs.FileType.File) for d in dirs]


def committed(root: str, filesystem=None) -> list[str]:
    """Directories under `root` with a manifest, oldest first (names sort by step)."""
    import pyarrow.fs as pafs

    return [path for path, has_manifest in _listed(root, filesystem or pafs.LocalFileSystem()) if has_manifest]


UNFINISHED = f"no {MANIFEST_FILE} (an unfinished save)"


def newest_valid(root: str, filesystem=None, *, checksums: bool = True) -> tuple[str | None, list[dict[str, str]]]:
    """(the newest checkpoint under `root` whose files match its manifest, on any pyarrow
    filesystem; the newer ones passed over, newest first, as {"path", "reason"}).

    Our own manifest decides, not a launcher's bookkeeping: a launcher killed just after a
    checkpoint was written may never have recorded it."""
    import pyarrow.fs as pafs

    skipped = []
    for path, has_manifest in reversed(_listed(root, filesystem or pafs.LocalFileSystem())):
        problem = verify(path, filesystem, checksums=checksums) if has_manifest else UNFINISHED
        if problem is None:
            return path, skipped
        log.debug("checkpoint %s skipped: %s", path, problem)  # the driver says it (its display)
        skipped.append({"path": path, "reason": problem})
    return None, skipped


def latest_valid(root: str, filesystem=None) -> str | None:
    """Newest checkpoint under `root` whose files match its manifest (see newest_valid)."""
    return newest_valid(root, filesystem)[0]


def prune(
    root: str,
    keep: int | None,
    filesystem=None,
    *,
    keep_best: int | None = None,
    best: tuple[str, str] = ("loss", "min"),
) -> list[str]:
    """Delete committed checkpoints except the newest `keep` (at least the latest, which resume
    needs) and the `keep_best` best by `best` = (eval metric, "min" | "max") among those measured
    at their own step. Rank 0, after a commit. Returns what was deleted."""
    import pyarrow.fs as pafs

    if keep is None and keep_best is None:
        return []
    fs = filesystem or pafs.LocalFileSystem()
    paths = committed(root, fs)
    retained = set(paths[-(keep or 1) :])
    if keep_best:
        metric, mode = best
        scored = []
        for path in paths:
            with fs.open_input_stream(f"{path}/{MANIFEST_FILE}") as f:
                value = (json.loads(f.read())["train_state"].get("eval_metrics") or {}).get(metric)
            if value is not None:
                scored.append((value if mode == "min" else -value, path))
        retained.update(path for _, path in sorted(scored)[:keep_best])
    doomed = [p for p in paths if p not in retained]
    for path in doomed:
        fs.delete_dir(path)
    return doomed
