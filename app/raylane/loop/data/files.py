"""Files a streaming source names, listed and read with pyarrow alone (no Ray): local paths or
`s3://` (pyarrow's S3 filesystem; `AWS_ENDPOINT_URL` points it at an S3-compatible server, as for
checkpoints in `raylane.loop.checkpoint.storage`).

The unit a rank reads is a *piece*: a Parquet row group, or a whole CSV, JSON Lines or text
file. Pieces are what ranks share out, so a single large Parquet file still splits across ranks.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from raylane.loop.checkpoint.storage import filesystem_for
from raylane.loop.data import baddata
from raylane.paths import is_uri, one_line, quick_filesystem

EXTENSIONS = {"parquet": (".parquet",), "csv": (".csv",), "json": (".json", ".jsonl"), "text": ()}
TEXT_ROWS_PER_CHUNK = 4096
TEXT_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class Piece:
    path: str
    row_group: int | None = None  # Parquet only; None: the whole file
    rows: int | None = None  # known from Parquet metadata, before any transform
    start: int = 0  # the file's rows before this piece's first (Parquet: earlier row groups)


def list_files(
    paths: str | Sequence[str], fmt: str, field: str = "paths", quick: bool = False
) -> tuple[pafs.FileSystem, list[str]]:
    """(filesystem, sorted file paths inside it) for files, directories (searched recursively,
    keeping the format's extensions) and globs. Raises ValueError naming `field` and the entry.
    `quick`: for a check before the run, object storage without the SDK's retries."""
    entries = [paths] if isinstance(paths, str) else list(paths)
    if not entries:
        raise ValueError(f"{field} = []: no files given")
    resolved = [quick_filesystem(e) if quick and is_uri(e) else filesystem_for(e) for e in entries]
    fs = resolved[0][0]
    if any(type(f) is not type(fs) for f, _ in resolved):
        raise ValueError(f"{field} = {entries!r}: all paths must be on one filesystem")
    files: list[str] = []
    for entry, (_, path) in zip(entries, resolved, strict=True):
        try:
            found = _expand(fs, path, fmt)
        except OSError as exc:  # an endpoint that cannot be reached, credentials refused
            raise ValueError(f"{field} = {entry!r}: cannot list it ({one_line(exc)})") from None
        if not found:
            raise ValueError(f"{field} = {entry!r}: no {fmt} files there")
        files += found
    return fs, sorted(set(files))


def _expand(fs: pafs.FileSystem, path: str, fmt: str) -> list[str]:
    if any(c in path for c in "*?["):
        base = path[: min(path.find(c) for c in "*?[" if c in path)].rsplit("/", 1)[0] or "/"
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        return [i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, path)]
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return [info.path]
    if info.type != pafs.FileType.Directory:
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    wanted = EXTENSIONS[fmt]
    # Hidden and underscore files are writers' bookkeeping (_SUCCESS, .crc), as Spark and Ray skip them.
    return [
        i.path
        for i in infos
        if i.type == pafs.FileType.File
        and not Path(i.path).name.startswith(("_", "."))
        and (not wanted or i.path.endswith(wanted))
    ]


def pieces(fs: pafs.FileSystem, files: Sequence[str], fmt: str, key: str = "paths") -> list[Piece]:
    """Parquet: one piece per row group, its row count from the footer (one small read per
    file). Other formats: one piece per file, rows unknown until read. A footer that cannot be
    read is a DataError naming `key` and the file."""
    if fmt != "parquet":
        return [Piece(f) for f in files]
    import pyarrow.parquet as pq

    out = []
    for f in files:
        try:
            meta = pq.read_metadata(f, filesystem=fs)
        except (pa.ArrowException, OSError) as exc:
            raise baddata.DataError(
                key,
                place=baddata.shown_path(fs, f),
                why=f"not a readable Parquet file ({type(exc).__name__}: {' '.join(str(exc).split())})",
            ) from exc
        start = 0
        for i in range(meta.num_row_groups):
            out.append(Piece(f, i, meta.row_group(i).num_rows, start))
            start += meta.row_group(i).num_rows
    return out


def checked_chunks(
    fs: pafs.FileSystem,
    piece: Piece,
    fmt: str,
    columns: Sequence[str] | None,
    transform: Callable[[dict], dict] | None,
    key: str,
    tally: baddata.Skipped | None = None,
) -> Iterator[dict[str, np.ndarray]]:
    """read_chunks, then `transform`, with the place of any failure: a read error is a DataError
    naming the file (and the row group), a transform's DataError gets its file and row, and
    any other exception of the transform (the user's code) a note with the rows it was given.
    With `tally` (skip_bad_rows), the rows a DataError names are dropped and counted there."""
    chunks, row = read_chunks(fs, piece, fmt, columns), 0
    while True:
        try:
            chunk = next(chunks, None)
        except Exception as exc:
            raise baddata.read_failure(fs, piece, fmt, row, exc, key, list(columns) if columns else None) from exc
        if chunk is None:
            return
        n = len(next(iter(chunk.values()))) if chunk else 0
        if transform is not None:
            try:
                if tally is None:
                    chunk = transform(chunk)
                else:
                    chunk = _skipping(fs, piece, fmt, row, transform, chunk, tally)
            except baddata.DataError as exc:
                baddata.locate_row(exc, fs, piece, fmt, row)
                raise
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python 3.11+: raylane.loop.usercode shows it
                    exc.add_note(
                        f"reading {baddata.shown_path(fs, piece.path)} rows {piece.start + row + 1}-"
                        f"{piece.start + row + n}"
                    )
                raise
        yield chunk
        row += n


def _skipping(fs, piece: Piece, fmt: str, row: int, transform, chunk: dict, tally: baddata.Skipped) -> dict:
    out, dropped, first = baddata.skipping(transform, chunk)
    tally.rows += len(next(iter(chunk.values()))) if chunk else 0
    tally.skipped += dropped
    if first is not None and tally.first is None:
        tally.first = baddata.skipped_line(baddata.locate_row(first, fs, piece, fmt, row))
    return out


def schema_names(fs: pafs.FileSystem, path: str, fmt: str, key: str = "paths") -> list[str]:
    """The column names of one file (its first chunk for CSV and JSON)."""
    if fmt == "text":
        return ["text"]
    first = next(checked_chunks(fs, Piece(path), fmt, None, None, key), None)
    return list(first) if first is not None else []


def read_chunks(
    fs: pafs.FileSystem, piece: Piece, fmt: str, columns: Sequence[str] | None
) -> Iterator[dict[str, np.ndarray]]:
    """The piece's rows as dicts of numpy arrays, in file order, in the reader's own chunks."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with fs.open_input_file(piece.path) as f:
            groups = None if piece.row_group is None else [piece.row_group]
            for batch in pq.ParquetFile(f).iter_batches(row_groups=groups, columns=columns):
                yield _numpy(batch)
    elif fmt == "text":
        yield from _text_chunks(fs, piece.path)
    else:
        with fs.open_input_stream(piece.path) as stream:
            if fmt == "csv":
                import pyarrow.csv as pacsv

                options = pacsv.ConvertOptions(include_columns=list(columns)) if columns else None
                reader = pacsv.open_csv(stream, convert_options=options)
            else:
                import pyarrow.json as pajson

                reader = pajson.open_json(stream)
            for batch in reader:
                yield _numpy(batch.select(list(columns)) if columns else batch)


def _numpy(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    return {
        name: col.to_numpy(zero_copy_only=False) for name, col in zip(batch.schema.names, batch.columns, strict=True)
    }


def _text_chunks(fs: pafs.FileSystem, path: str) -> Iterator[dict[str, np.ndarray]]:
    """One row per non-empty line, column `text`: what Ray Data's read_text gives."""
    rest, lines = b"", []
    with fs.open_input_stream(path) as stream:
        while block := stream.read(TEXT_READ_BYTES):
            *complete, rest = (rest + block).split(b"\n")
            lines += [line.rstrip(b"\r").decode("utf-8") for line in complete if line.rstrip(b"\r")]
            while len(lines) >= TEXT_ROWS_PER_CHUNK:
                yield {"text": np.array(lines[:TEXT_ROWS_PER_CHUNK], dtype=object)}
                lines = lines[TEXT_ROWS_PER_CHUNK:]
    if rest.rstrip(b"\r"):
        lines.append(rest.rstrip(b"\r").decode("utf-8"))
    if lines:
        yield {"text": np.array(lines, dtype=object)}
