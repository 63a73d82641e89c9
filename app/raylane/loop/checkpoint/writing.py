"""Writing a checkpoint durably. A sharded state (FSDP) is saved with torch.distributed.checkpoint:
every rank writes its own shard, rank 0 the metadata, and it loads at another world size. A
replicated state (DDP, one process), the same on every rank, is written by rank 0 alone as one
`state.pt` (`torch.save`, loaded with `weights_only=True`), with every rank's random generators,
which reach rank 0 in the commit's gather: DCP's planning and metadata cost several times the
write itself for small models (bench B9), and a file per rank is a write per rank on object
storage. Both load into DDP, FSDP or one process, at any world size (raylane.loop.checkpoint.loading);
replicated checkpoints written by earlier versions in DCP's format still load.

Each checkpoint is a fresh directory committed by `manifest.json`, written last and atomically by
rank 0. It holds the train state (epoch, step, position in the epoch, the resolved config,
raylane's version), the shape of every model parameter and buffer, and the size and SHA-256 of
every file of every rank (read and checked by raylane.loop.checkpoint.manifest). A directory without a
manifest, or whose files do not match it (truncated, bit-flipped, missing), is never loaded:
the newest valid one is used instead. Every file is fsynced before the manifest may name it.

A checkpoint is saved in two halves. `raylane.loop.checkpoint.staging.Stager.stage` copies the state into
CPU buffers kept from one save to the next: the only part that must happen between two optimizer
steps. `write` and `PendingSave.commit` (DCP's collectives, the files, the checksums, the
manifest) can then run on a background thread, whose collectives go to the group given to
`raylane.loop.checkpoint.agree.collectives_on`."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from raylane.loop.checkpoint.agree import current_group, describe, raise_if_any, save_errors, vote
from raylane.loop.checkpoint.aliases import aliases
from raylane.loop.checkpoint.frozen import records_of
from raylane.loop.checkpoint.manifest import MANIFEST_FILE, sha256
from raylane.loop.checkpoint.rng import rng_file, rng_state
from raylane.loop.checkpoint.state import (
    FLAT,
    STATE_FILE,
    dcp,
    flat_optim,
    live_state,
    model_shapes,
    partial,
    replicated,
)


class PendingSave:
    """A checkpoint whose shards are written but which is not committed yet. `commit()` is
    collective: every rank calls it, on the same group as the write. A replicated state is
    written at the commit instead: rank 0's `whole` state, with every rank's `rng`."""

    def __init__(
        self,
        path: Path,
        rank: int,
        train_state: dict[str, Any],
        error: str | None = None,
        shapes: dict[str, list[int]] | None = None,
        *,
        whole: dict[str, Any] | None = None,
        rng: str | None = None,
        replicated: bool = False,
        aliases: dict[str, str] | None = None,
        records: dict[str, Any] | None = None,
        part: bool = False,
        flat: bool = False,
    ) -> None:
        self.path, self.rank, self.train_state, self.error = path, rank, train_state, error
        self.shapes, self.whole, self.rng, self.replicated = shapes, whole, rng, replicated
        self.aliases, self.records, self.part, self.flat = aliases, records or {}, part, flat

    @property
    def step(self) -> int:
        return int(self.train_state["step"])

    def commit(self) -> None:
        """Gather every rank's checksums and let rank 0 write the manifest: the commit. Any rank's
        failure raises CheckpointSaveError on all ranks. The last vote, after rank 0's manifest,
        is also what keeps every rank from going on before the commit exists."""
        files: dict[str, Any] = {}
        error = self.error
        try:
            if error is None and not self.replicated:  # a replicated state has no file before the commit
                files = _own_files(self.path, self.rank)
        except OSError as exc:  # reported on every rank below
            error = describe(exc, self.rank)
        # A partial model's ranks hold different parameters: the manifest lists every rank's.
        shapes = self.shapes if self.part else None
        gathered = vote(self.step, {"files": files, "error": error, "rng": self.rng, "shapes": shapes})
        if self.part and self.rank == 0:
            self.shapes = {k: v for part in gathered for k, v in (part["shapes"] or {}).items()}
        manifest_error = None
        if self.rank == 0:
            try:
                if self.whole is not None:
                    files[STATE_FILE] = _save_durably(
                        self.path / STATE_FILE, {**self.whole, "rng": [part["rng"] for part in gathered]}
                    )
                _write_manifest(self.path, self._manifest([*gathered[1:], {"files": files}]))
            except save_errors() as exc:
                manifest_error = describe(exc, 0)
        raise_if_any(self.step, manifest_error, only_rank_zero=True)

    def _manifest(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """The commit record, naming every file of every rank (`parts`: each rank's "files")."""
        # The model's other names for tensors saved once (raylane.loop.checkpoint.aliases), for readers.
        named: dict[str, Any] = {"aliases": self.aliases} if self.aliases else {}
        # What the state depends on and does not hold (raylane.loop.checkpoint.frozen): a frozen
        # base, whose weights it leaves out, and the tokenizer of its inputs.
        named.update(self.records)
        return {
            "train_state": self.train_state,
            "shapes": self.shapes,
            # The optimizer's state by parameter name (raylane.loop.checkpoint.state.flat_optim).
            **({"optim_state": FLAT} if self.flat else {}),
            **named,
            "files": {k: v for part in parts for k, v in part["files"].items()},
        }


def _digest(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return {"size": path.stat().st_size, "sha256": sha256(f)}


def _own_files(path: Path, rank: int) -> dict[str, dict[str, Any]]:
    """The files this rank wrote into a sharded checkpoint (DCP names data files
    `__<rank>_<n>.distcp`); a replicated state's `state.pt` is written later, by the commit."""
    names = [*path.glob(f"__{rank}_*.distcp"), path / rng_file(rank)]
    if rank == 0:
        names.append(path / ".metadata")
    return {p.name: _digest(p) for p in names if p.is_file()}


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    tmp = path / (MANIFEST_FILE + ".tmp")
    # One line: json's C encoder does not indent, and its Python one cost ~0.5 ms per save on 2
    # busy cores (bench B9). `python -m json.tool manifest.json` shows it indented.
    _write_durably(tmp, json.dumps(manifest, sort_keys=True))
    os.replace(tmp, path / MANIFEST_FILE)  # the commit: appears whole or not at all
    _fsync_dir(path)  # the rename itself, and the checkpoint's own entry in its parent
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    # DCP fsyncs its own files; a manifest may only name files that would survive a crash.
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class _Hashing:
    """A file's write(), hashing what goes through it: a digest without reading the file back
    and without holding it whole in memory."""

    def __init__(self, f: io.BufferedWriter) -> None:
        self.f, self.digest, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _save_durably(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """torch.save `state` to `path`, fsynced; returns its size and SHA-256."""
    with open(path, "wb") as f:
        hashing = _Hashing(f)
        torch.save(state, hashing)
        f.flush()
        os.fsync(f.fileno())
    return {"size": hashing.size, "sha256": hashing.digest.hexdigest()}


def write(
    path: str | os.PathLike,
    state: dict[str, Any],
    train_state: dict[str, Any],
    *,
    rank: int,
    rng: dict[str, Any],
    error: str | None = None,
    replicated: bool = False,
    aliases: dict[str, str] | None = None,
    records: dict[str, Any] | None = None,
    part: bool = False,
) -> PendingSave:
    """Collective (on the group of `collectives_on`): write this rank's shard of `state` and its
    random generators into `path`. A rank that failed before (`error`: staging) still takes
    part in DCP's collectives, with nothing to write. Errors are kept for `commit()`, so that
    every rank learns of them together.

    A `replicated` state is written by `commit()`: rank 0 alone writes it, as one `state.pt`
    holding every rank's generators too. Every rank would write an identical copy, and DCP's
    planning (about a dozen collectives and their pickles) and metadata cost more than the write
    itself for small models (bench B9). `aliases`: the model's other names for tensors the state
    holds once (recorded in the manifest); `records`: raylane.loop.checkpoint.frozen.records_of (idem);
    `part`: the model is a part of the whole (raylane.loop.checkpoint.state.partial). The
    optimizer's state is written flat, by parameter name, whatever the layout."""
    path = Path(path)
    if state.get("optim") is not None:
        state = {**state, "optim": flat_optim(state["optim"])}
    shapes = model_shapes(state.get("model") or {}) if (rank == 0 or part) and error is None else None
    if replicated:
        whole = state if rank == 0 and error is None else None
        # As one JSON string: torch.save pickles a list of ~1,250 ints per rank in Python, ~1 ms.
        return PendingSave(
            path,
            rank,
            train_state,
            error=error,
            shapes=shapes,
            whole=whole,
            rng=json.dumps(rng),
            replicated=True,
            aliases=aliases,
            records=records,
            part=part,
            flat=True,
        )
    try:
        dcp().save({} if error else state, checkpoint_id=str(path), process_group=current_group())
        if error is None:
            _write_durably(path / rng_file(rank), json.dumps(rng))
    except save_errors() as exc:  # reported on every rank by commit()
        error = error or describe(exc, rank)
    return PendingSave(
        path, rank, train_state, error=error, shapes=shapes, aliases=aliases, records=records, part=part, flat=True
    )


def begin_save(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    *,
    rank: int,
) -> PendingSave:
    """Collective: every rank calls it with its own `path` (the same one on shared storage).
    Writes the live state on this thread; `commit()` next."""
    error, state = None, {}
    try:
        state = live_state(model, optimizer)
    except save_errors() as exc:
        error = describe(exc, rank)
    return write(
        path,
        state,
        train_state,
        rank=rank,
        rng=rng_state(),
        error=error,
        replicated=replicated(model),
        aliases=aliases(model),
        records=records_of(model),
        part=partial(model),
    )


def save(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    *,
    rank: int,
) -> None:
    """Synchronous save and commit (collective)."""
    begin_save(path, model, optimizer, train_state, rank=rank).commit()
