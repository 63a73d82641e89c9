"""Where a run's checkpoints live: a local or shared directory, or any pyarrow filesystem
(`s3://bucket/prefix`). The same for every launcher, and owned by raylane rather than by Ray
Train's checkpoint manager, so that retention (`checkpoint.keep`, `keep_best`) and the commit
order are ours: every rank's files first, rank 0's manifest last.

On a filesystem every rank can write (local, NFS) ranks write straight into the checkpoint
directory. On object storage each rank stages its files in a local temporary directory and
uploads them; rank 0 uploads the manifest only after every rank's upload succeeded."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs

from raylane.loop.checkpoint.agree import raise_if_any
from raylane.loop.checkpoint.manifest import MANIFEST_FILE, checkpoint_name, newest_valid, prune


def filesystem_for(storage_path: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or a URI such as `s3://bucket/prefix`."""
    if "://" not in storage_path:
        return pafs.LocalFileSystem(), str(Path(storage_path).expanduser().resolve())
    return pafs.FileSystem.from_uri(storage_path)


@contextlib.contextmanager
def local_copy(location: str) -> Iterator[str]:
    """A local directory with the checkpoint at `location` (a path, or a URI: downloaded)."""
    fs, path = filesystem_for(location)
    if isinstance(fs, pafs.LocalFileSystem):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="raylane-ckpt-") as local:
        pafs.copy_files(path, local, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        yield local


class CheckpointStore:
    """A run's checkpoints in storage, as one rank sees them: `root` on `fs` (a local or shared
    folder when None). `latest` finds the one to resume from (`skipped`: the newer ones it passed
    over), `new_dir` is where this rank writes a save, `commit` puts a written save into storage
    and applies retention, `discard` removes a save that failed. Every launcher hands the loop
    one as `Runtime.store`, and the Saver commits through it; a launcher that must do more at
    these points subclasses it (raylane.onray.store.DriverWatchedStore)."""

    def __init__(self, root: str, fs: pafs.FileSystem | None, rank: int) -> None:
        self.root, self.rank = root.rstrip("/"), rank
        self.fs = fs or pafs.LocalFileSystem()
        self.direct = isinstance(self.fs, pafs.LocalFileSystem)
        self.skipped: list[dict[str, str]] = []  # by latest()

    def latest(self) -> str | None:
        """A local directory holding the newest valid checkpoint (downloaded if remote), or None.
        The newer ones it passed over are kept in `skipped` ({"path", "reason"}, newest first)."""
        path, skipped = newest_valid(self.root, self.fs)
        self.skipped = [
            {**s, "path": s["path"] if self.direct else f"{self.fs.type_name}://{s['path']}"} for s in skipped
        ]
        if path is None or self.direct:
            return path
        local = tempfile.mkdtemp(prefix="raylane-restore-")
        atexit.register(shutil.rmtree, local, True)  # a copy, needed only until it is loaded
        pafs.copy_files(path, local, source_filesystem=self.fs, destination_filesystem=pafs.LocalFileSystem())
        return local

    def new_dir(self, step: int) -> str:
        """The folder this rank writes the save at `step` into, made (OSError when it cannot be)."""
        if self.direct:
            path = Path(self.root) / checkpoint_name(step)
            path.mkdir(parents=True, exist_ok=True)
            return str(path)
        return tempfile.mkdtemp(prefix=f"raylane-{checkpoint_name(step)}-")

    def unmade_dir(self, step: int) -> str:
        """The folder `new_dir` could not make: where this rank's part of the failed save points
        (a sharded write's collectives still name one), and what `discard` removes."""
        if self.direct:
            return str(Path(self.root) / checkpoint_name(step))
        return os.path.join(tempfile.gettempdir(), f"raylane-{checkpoint_name(step)}-rank{self.rank}-unmade")

    def location(self, step: int) -> str:
        path = f"{self.root}/{checkpoint_name(step)}"
        return path if self.direct else f"{self.fs.type_name}://{path}"

    def commit(self, path: str, step: int, *, keep: int | None, keep_best: int | None, best: tuple[str, str]) -> str:
        """Collective, after `PendingSave.commit()` wrote the manifest into rank 0's `path`:
        make the checkpoint durable in storage, then prune (rank 0). Returns its location.

        Written straight into storage, the manifest is already the commit, and commit()'s last
        gather already held every rank until it existed: nothing is left to agree on."""
        if not self.direct:
            self._upload(path, f"{self.root}/{checkpoint_name(step)}", step)
        if self.rank == 0:
            prune(self.root, keep, self.fs, keep_best=keep_best, best=best)
        return self.location(step)

    def _upload(self, path: str, target: str, step: int) -> None:
        manifest = os.path.join(path, MANIFEST_FILE)
        try:
            error = self._try(lambda: self._copy_out(path, target, skip=MANIFEST_FILE))
            raise_if_any(step, error)
            error = self._try(lambda: self._copy_file(manifest, target)) if self.rank == 0 else None
            raise_if_any(step, error, only_rank_zero=True)
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def _try(self, action) -> str | None:
        try:
            action()
            return None
        except OSError as exc:
            return f"rank {self.rank}: {type(exc).__name__}: {exc}"

    def _copy_out(self, path: str, target: str, skip: str) -> None:
        self.fs.create_dir(target, recursive=True)
        for name in sorted(os.listdir(path)):
            if name != skip:
                self._copy_file(os.path.join(path, name), target)

    def _copy_file(self, source: str, target: str) -> None:
        with open(source, "rb") as src, self.fs.open_output_stream(f"{target}/{os.path.basename(source)}") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)

    def discard(self, path: str) -> None:
        """Collective: remove what a failed save left (every rank has finished writing)."""
        if not self.direct:
            shutil.rmtree(path, ignore_errors=True)  # only ever a local staging directory
        elif self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
