"""raylane's errors, in a module of their own so that every layer, the lowest included (pipeline
references, paths, the config), can raise or recognise them: ConfigError for a config or an
argument, DataError for a value in the data, TrainingError for a run whose ranks failed. Every
exception class of raylane derives from RaylaneError, and also from the builtin it always
derived from (ValueError, RuntimeError), so that `except ValueError` still catches a ConfigError."""

from __future__ import annotations

import math
from typing import Any

# What a bad row's message adds in the shipped pipelines (tabular and text write the same words,
# importing only raylane's public names), and what the record of a skipped row leaves out.
SKIP_HINT = " (data.skip_bad_rows: true skips such rows)"


class RaylaneError(Exception):
    """The base of every exception raylane raises on purpose: `except RaylaneError` catches
    them all, and a caller matches one by its class (never by its name)."""


class ConfigError(RaylaneError, ValueError):
    """Bad user input. The message is complete and meant for the user as is."""


class TrainingError(RaylaneError, RuntimeError):
    """The run failed; the message names the failing rank(s) and their exceptions."""


class DataError(RaylaneError, ValueError):
    """A bad value in the data. Raise it from a FileSource's transform: `key` is what the value
    breaks (a config key and its value, "data.num_classes = 3", or the key naming the column,
    "data.features"), `column` the column, `row` the row's index in the transform's batch,
    `value` the bad value (None: the cell is empty or null) and `why` what was expected. The
    reader adds `place`: the file and the row. Without a column, `why` alone says what is wrong.
    `rows`: every bad row of the batch, when the transform found them all at once (the message
    names `row`, the first; a source that skips bad rows drops them all in one go)."""

    def __init__(
        self,
        key: str,
        *,
        column: str | None = None,
        row: int | None = None,
        value: Any = None,
        why: str = "",
        place: str | None = None,
        rows: list[int] | None = None,
    ) -> None:
        super().__init__(key)
        self.key, self.column, self.row, self.value, self.why, self.place = key, column, row, value, why, place
        self.rows = rows
        self.raw: str | None = None  # a null cell's text in the file ('n/a'), where it can be read

    def __str__(self) -> str:
        where = self.place or "a batch of the data (not located)"
        if self.column is None:
            return f"{self.key}: {where}: {self.why}"
        if is_missing(self.value):
            shown = "no value" + (f" ({self.raw!r})" if self.raw else "")
        else:
            shown = _shown(self.value)
        return f"{self.key}: {where}, column {self.column!r} has {shown}" + (f"; {self.why}" if self.why else "")

    def __reduce__(self):  # to the driver through Ray, fields and all
        return (_rebuild, (self.key, dict(self.__dict__)))


def _rebuild(key: str, state: dict[str, Any]) -> DataError:
    error = DataError(key)
    error.__dict__.update(state)
    return error


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))  # NaN: a null read as a float


SHOWN_CHARS = 80  # a bad value shown in full could be a whole document: one line stays one line


def _shown(value: Any) -> str:
    text = repr(_plain(value))
    return text if len(text) <= SHOWN_CHARS else f"{text[: SHOWN_CHARS - 3]}..."


def _plain(value: Any) -> Any:
    """numpy's scalars and arrays (a JSON list read by pyarrow) as Python's: repr `5`, not
    `np.int64(5)`; `['a']`, not `array(['a'], dtype=object)`."""
    if hasattr(value, "tolist") and hasattr(value, "ndim"):
        return value.tolist()
    return value


def ranks_text(numbers: list[int]) -> str:
    """'rank 3', 'ranks 0, 2', 'ranks 0-255, 300': runs of three or more as a range, so that a line
    naming ranks does not grow with them when they come in runs (a node's, every rank but one)."""
    numbers = sorted(set(numbers))
    if len(numbers) == 1:
        return f"rank {numbers[0]}"
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    parts = [f"{r[0]}-{r[-1]}" if len(r) >= 3 else ", ".join(map(str, r)) for r in runs]
    return "ranks " + ", ".join(parts)
