"""Bad data, said in one line: the config key it breaks, the file, the row (or the Parquet row
group), the column and the value, e.g. `data.num_classes = 3: data/train.csv row 17, column
'label' has 5; class ids are 0..2`.

A FileSource's transform raises `DataError` for a bad value, with the row's index in the batch it
was given; the reader (raylane.loop.data.files.checked_chunks) knows which file and rows the batch
came from and fills in the place. Rows are counted from 1 in each file (a CSV's header is not a
row). What arrives without a place (Ray Data's tasks report only text) is found again by reading
the files with pyarrow (raylane.loop.data.streaming.locate), once the run has already failed."""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raylane.errors import SKIP_HINT, DataError, is_missing
from raylane.logs import strip_colour

_CSV_CONVERSION = re.compile(r"CSV conversion error to (\w+): invalid value '(.*)'$")
# pyarrow gives the row's text (at times a "Row #N" of its own counting): the row is found by its text.
_CSV_FIELDS = re.compile(r"CSV parse error: (?:Row #\d+: )?Expected (\d+) columns, got (\d+): (.*)$")
# pyarrow's JSON reader: the row is counted from 0 in the block being parsed, not in the file.
_JSON_ROW = re.compile(r"^(JSON parse error: .*) in row (\d+)$")
_JSON_TYPE = re.compile(r"Column\(/([^)/]+)\) changed from (\w+) to (\w+)")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Invalid)): (.+)$")


def cause_line(text: str) -> str:
    """The original exception's line (`ValueError: ...`) in a traceback Ray sends as text (a
    Ray Data task's, in colour): the first one, before the chain of Ray's own wrappers."""
    lines = strip_colour(text).splitlines()
    found = [line.strip() for line in lines if _EXCEPTION_LINE.match(line.strip())]
    return found[0] if found else next((line.strip() for line in lines if line.strip()), text)


def shown_path(fs: Any, path: str) -> str:
    return f"s3://{path}" if getattr(fs, "type_name", "") == "s3" else path


def row_place(fs: Any, piece: Any, row: int) -> str:
    """Where row `row` (0-based, counted from the piece's first row) of a piece is in its file."""
    return f"{shown_path(fs, piece.path)} row {piece.start + row + 1}"


def piece_place(fs: Any, piece: Any) -> str:
    if piece.row_group is None:
        return shown_path(fs, piece.path)
    rows = f" (rows {piece.start + 1}-{piece.start + piece.rows})" if piece.rows else ""
    return f"{shown_path(fs, piece.path)} row group {piece.row_group}{rows}"


def read_failure(
    fs: Any, piece: Any, fmt: str, row: int, exc: BaseException, key: str, columns: list[str] | None
) -> DataError:
    """A DataError for a piece that could not be read past its first `row` rows."""
    text = " ".join(str(exc).split())
    conversion = _CSV_CONVERSION.search(text) if fmt == "csv" else None
    if conversion:  # a value unlike the column's first rows (pyarrow's message has no row)
        wanted, value = conversion.groups()
        where = find_csv_value(fs, piece.path, columns, value, after=row)
        if where:
            kind = (
                "a number"
                if "double" in wanted or "float" in wanted
                else "an integer"
                if "int" in wanted
                else f"a {wanted}"
            )
            return DataError(
                key,
                column=where[1],
                value=value,
                why=f"expected {kind}, as in the rows before it",
                place=row_place(fs, piece, where[0]),
            )
    parse = _JSON_ROW.search(text) if fmt == "json" else None
    if parse:
        return _json_failure(fs, piece, row + int(parse.group(2)), parse.group(1), exc, key)
    fields = _CSV_FIELDS.search(text) if fmt == "csv" else None
    found = find_csv_line(fs, piece.path, fields.group(3), after=row) if fields else None
    if fields and found is not None:
        wanted, got = fields.group(1), fields.group(2)
        return DataError(
            key,
            why=f"{got} fields where the header has {wanted} (a CSV row has every column: an empty field for a "
            "missing value)",
            place=row_place(fs, piece, found),
        )
    place = (
        piece_place(fs, piece)
        if row == 0 or piece.row_group is not None
        else f"{shown_path(fs, piece.path)} after row {piece.start + row}"
    )
    return DataError(key, why=f"cannot be read ({type(exc).__name__}: {text})", place=place)


def _json_failure(fs: Any, piece: Any, row: int, text: str, exc: BaseException, key: str) -> DataError:
    """A JSON Lines row pyarrow could not parse: its place in the file (row from 0), and for a
    value of another type than the column's earlier rows, the column and the value."""
    changed = _JSON_TYPE.search(text)
    if changed:
        column, before, now = changed.groups()
        value = None
        with contextlib.suppress(Exception):  # the value is a courtesy; the place is what matters
            value = json.loads(_json_line(fs, piece.path, row)).get(column)
        return DataError(
            key,
            column=column,
            value=value,
            why=f"{_article(now)} where the rows before it have {_article(before)} (a JSON Lines column holds "
            "one type; data.skip_bad_rows cannot skip a row the reader cannot read)",
            place=row_place(fs, piece, row),
        )
    return DataError(key, why=f"cannot be read ({type(exc).__name__}: {text})", place=row_place(fs, piece, row))


def _article(kind: str) -> str:
    return f"an {kind}" if kind[:1] in "aeiou" else f"a {kind}"


def _json_line(fs: Any, path: str, row: int) -> str:
    """Row `row` (from 0) of a JSON Lines file: its non-blank lines, as pyarrow counts them."""
    with fs.open_input_stream(path) as stream:
        lines = (line for line in io.TextIOWrapper(stream, encoding="utf-8", errors="replace") if line.strip())
        return next(line for i, line in enumerate(lines) if i == row)


def _raw_csv(fs: Any, path: str, columns: list[str] | None):
    """A CSV file's batches with every cell as the text in the file (nulls not converted)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    if not columns:
        with fs.open_input_stream(path) as stream:
            columns = pacsv.open_csv(stream).schema.names
    options = pacsv.ConvertOptions(
        include_columns=list(columns),
        column_types=dict.fromkeys(columns, pa.string()),
        strings_can_be_null=False,
        quoted_strings_can_be_null=False,
    )
    with fs.open_input_stream(path) as stream:
        yield from pacsv.open_csv(stream, convert_options=options)


def raw_csv_value(fs: Any, path: str, column: str, row: int) -> str | None:
    """The text of a CSV file's cell, `row` counted from 0 after the header."""
    seen = 0
    for batch in _raw_csv(fs, path, [column]):
        if row < seen + batch.num_rows:
            return batch.column(0)[row - seen].as_py()
        seen += batch.num_rows
    return None


def find_csv_value(fs: Any, path: str, columns: list[str] | None, value: str, after: int = 0) -> tuple[int, str] | None:
    """(row from 0, column) of the first cell at or after row `after` whose text is `value`."""
    seen = 0
    try:
        for batch in _raw_csv(fs, path, columns):
            if seen + batch.num_rows > after:
                for name, cells in zip(batch.schema.names, batch.columns, strict=True):
                    hits = [i for i, cell in enumerate(cells.to_pylist()) if cell == value and seen + i >= after]
                    if hits:
                        return seen + hits[0], name
            seen += batch.num_rows
    except Exception:  # noqa: BLE001 - looking for the row only: the read error is reported anyway
        return None
    return None


def find_csv_line(fs: Any, path: str, text: str, after: int = 0) -> int | None:
    """The row (from 0, after the header) of the first line at or after row `after` that reads
    `text`: a line pyarrow could not parse, found by its text (its message has no row)."""
    with contextlib.suppress(Exception), fs.open_input_stream(path) as stream:
        lines = io.TextIOWrapper(stream, encoding="utf-8", errors="replace")
        next(lines, None)  # the header
        for i, line in enumerate(lines):
            if i >= after and line.rstrip("\r\n") == text:
                return i
    return None


def locate_row(error: DataError, fs: Any, piece: Any, fmt: str, offset: int) -> DataError:
    """`error`, raised by a transform on the chunk that starts `offset` rows into `piece`, with
    its place (and for a null CSV cell, the cell's text)."""
    if error.place is not None:
        return error
    if error.row is None:
        error.place = (
            piece_place(fs, piece) if offset == 0 else f"{shown_path(fs, piece.path)} after row {piece.start + offset}"
        )
        return error
    row = offset + error.row
    error.place = row_place(fs, piece, row)
    if fmt == "csv" and error.column is not None and is_missing(error.value):
        with contextlib.suppress(Exception):  # the text is a courtesy; the place is what matters
            error.raw = raw_csv_value(fs, piece.path, error.column, piece.start + row)
    return error


# -- skipping bad rows ----------------------------------------------------------------------------


@dataclass
class Skipped:
    """What readers skipped of one data set: the rows read, the bad ones dropped, and the first
    bad row's line (its place named where the reader knows it); and what its transform counted
    (raylane.loop.data.streaming.COUNT: examples cut to a sequence, say)."""

    rows: int = 0
    skipped: int = 0
    first: str | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, other: Skipped, counts: dict[str, int] | None = None) -> Skipped:
        """`other`'s counts (and `counts`) added to these; the first line stays this one's
        (earlier in file order)."""
        self.rows += other.rows
        self.skipped += other.skipped
        self.first = self.first or other.first
        for name, n in (*other.counts.items(), *(counts or {}).items()):
            self.counts[name] = self.counts.get(name, 0) + n
        return self


def skipping(transform: Callable[[dict], dict], batch: dict) -> tuple[dict, int, DataError | None]:
    """transform(batch) without the rows its DataErrors name: (its output, the rows dropped, the
    first DataError, its `row` counted in `batch`). Each DataError drops its `rows` (or its
    `row`) and the rest is transformed again; one that names no row (the whole batch) is raised."""
    index: np.ndarray | None = None
    dropped, first = 0, None
    while True:
        try:
            return transform(batch), dropped, first
        except DataError as exc:
            size = len(next(iter(batch.values()))) if batch else 0
            rows = sorted({int(r) for r in (exc.rows or ([] if exc.row is None else [exc.row]))})
            if not rows or rows[0] < 0 or rows[-1] >= size:
                raise
            index = np.arange(size) if index is None else index
            if first is None:
                exc.row, exc.rows, first = int(index[rows[0] if exc.row is None else exc.row]), None, exc
            keep: np.ndarray = np.ones(size, dtype=bool)
            keep[rows] = False
            batch, index = {k: v[keep] for k, v in batch.items()}, index[keep]
            dropped += len(rows)


def skipped_line(error: DataError) -> str:
    """A skipped row's line, without the hint to skip it."""
    return str(error).replace(SKIP_HINT, "")


def skip_key(label: str) -> str:
    """The config key of skipping for the data of config key `label` (data.train: data.skip_bad_rows)."""
    return f"{label.rsplit('.', 1)[0]}.skip_bad_rows" if label.startswith("data.") else "skip_bad_rows"


# Bad rows skipped in this process, by the config key of their data (data.train): recorded where
# the rows are counted before training (the Ray driver, every torchrun rank, a dataset tokenized
# at once), for the summary. A relaunch or restart counts again and replaces its record.
_SKIPPED: dict[str, Skipped] = {}


def record_skipped(label: str, tally: Skipped, limit: bool | int, key: str | None = None) -> None:
    """Records what was skipped of `label`'s data; more rows than `limit` (an int) is a DataError
    naming `key` (by default the skip key beside `label`'s)."""
    _SKIPPED[label] = tally
    if limit is not True and tally.skipped > limit:
        raise DataError(
            f"{key or skip_key(label)} = {limit}",
            place=label,
            why=f"{tally.skipped:,} bad rows of {tally.rows:,}, more than {limit:,}"
            + (f"; the first: {tally.first}" if tally.first else ""),
        )


def skipped_rows() -> dict[str, dict[str, Any]]:
    """What this process recorded, as the summary's `skipped_rows`."""
    return {label: {**vars(tally), "counts": dict(tally.counts)} for label, tally in _SKIPPED.items()}


def forget_skipped() -> None:
    """A new launch in this process (raylane.train() called again) starts with no record."""
    _SKIPPED.clear()


def take_skipped(label: str) -> Skipped | None:
    """`label`'s record, removed (to be recorded again, merged, under another label)."""
    return _SKIPPED.pop(label, None)
