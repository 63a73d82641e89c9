"""Bad data, said in one line: the config key it breaks, the file, the row (or the Parquet row
group), the column and the value, e.g. `data.num_classes = 3: data/train.csv row 17, column
'label' has 5; class ids are 0..2`.

A FileSource's transform raises `DataError` for a bad value, with the row's index in the batch it
was given; the reader (raylane.loop.files.checked_chunks) knows which file and rows the batch
came from and fills in the place. Rows are counted from 1 in each file (a CSV's header is not a
row). What arrives without a place (Ray Data's tasks report only text) is found again by reading
the files with pyarrow (raylane.loop.streaming.locate), once the run has already failed."""

from __future__ import annotations

import contextlib
import re
from typing import Any

from raylane.errors import DataError, _missing

_COLOUR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CSV_CONVERSION = re.compile(r"CSV conversion error to (\w+): invalid value '(.*)'$")
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Invalid)): (.+)$")


def strip_colour(text: str) -> str:
    return _COLOUR.sub("", text)


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
    place = (
        piece_place(fs, piece)
        if row == 0 or piece.row_group is not None
        else f"{shown_path(fs, piece.path)} after row {piece.start + row}"
    )
    return DataError(key, why=f"cannot be read ({type(exc).__name__}: {text})", place=place)


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
    if fmt == "csv" and error.column is not None and _missing(error.value):
        with contextlib.suppress(Exception):  # the text is a courtesy; the place is what matters
            error.raw = raw_csv_value(fs, piece.path, error.column, piece.start + row)
    return error
