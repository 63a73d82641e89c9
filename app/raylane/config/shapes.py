"""Whether the config is checked for a build of shapes alone: `raylane check --world N` (the
rehearsal) and `raylane check --plan`/`--blocks` build the model on the meta device and read no
weights, so a pipeline may accept what such a build does not need and a run does (raylane.hf: a
model folder holding only its config.json). Everything else, `raylane train` and `raylane check`
without those flags included, checks for the run."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("raylane_shapes_only", default=False)


def shapes_only() -> bool:
    """Whether the checks running now are for a build of shapes alone (no weights read)."""
    return _SHAPES_ONLY.get()


@contextlib.contextmanager
def for_shapes(on: bool = True) -> Iterator[None]:
    """Inside (when `on`): the config's checks and builds are for shapes alone."""
    token = _SHAPES_ONLY.set(on or _SHAPES_ONLY.get())
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)
