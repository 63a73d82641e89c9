"""A failed worker group in one line: each rank's exception, ranks that failed alike together;
the ranks' whole tracebacks go to the library log."""

from __future__ import annotations

import re

from raylane import logs
from raylane.errors import ConfigError, DataError, ranks_text
from raylane.loop.observe.hangs import HangError
from raylane.loop.observe.rankfailures import MAX_SHOWN, is_echo
from raylane.loop.usercode import TRACEBACK_ATTR
from raylane.pipelines_ref import UserCodeError

# gloo prefixes its errors with a C++ source location; it says nothing to a user.
_SOURCE_LOCATION = re.compile(r"^\[[^]]*\] ")


def format_failure(exc: BaseException, world_size: int) -> str:
    """One line for a failed worker group: each rank's exception (ranks that failed alike
    together); the ranks' tracebacks go to the library log."""
    failures = getattr(exc, "worker_failures", None) or {}
    kept = {rank: getattr(err, TRACEBACK_ATTR, None) for rank, err in failures.items()}
    if failures and all(kept.values()):  # whole, where Ray's message cuts them short
        for rank, text in sorted(kept.items()):
            logs.record_traceback(f"training failed on rank {rank}:", str(text))
    else:
        logs.record_traceback("training failed; the ranks' tracebacks:", str(exc))
    if not failures:
        return f"training failed: {type(exc).__name__}: {_one_line(exc)}"
    # A rank whose peer went (gloo's 'Connection closed by peer [addr]:port', a different port each)
    # echoes another's failure: said as a count after it, so that the line does not grow with the
    # ranks (at 16 ranks a hang's line carried three such echoes, 150 characters each).
    causes = {rank: err for rank, err in failures.items() if not is_echo(err)} or failures
    ranks: dict[str, list[int]] = {}
    for rank, err in sorted(causes.items()):
        shown = (
            str(err)
            if isinstance(err, (UserCodeError, DataError, HangError, ConfigError))
            else f"{type(err).__name__}: {_one_line(err)}"
        )
        ranks.setdefault(shown, []).append(rank)
    parts = [f"{ranks_text(r)}: {text}" for text, r in list(ranks.items())[:MAX_SHOWN]]
    more = len(ranks) - MAX_SHOWN
    text = (
        "training failed on " + "; ".join(parts) + (f" (and {more} other error{'s' * (more > 1)})" if more > 0 else "")
    )
    echoes = sorted(set(failures) - set(causes))
    if echoes:
        text += f" ({ranks_text(echoes)}: a peer gone, after it)"
    silent = sorted(set(range(world_size)) - set(failures))
    hung = any(isinstance(err, HangError) for err in failures.values())  # its line names them, and where
    if silent and not hung and any("timed out" in str(err).lower() for err in failures.values()):
        # Ranks that timed out were waiting in a collective; the ones that raised nothing never came.
        text += f" (no error from rank {', '.join(map(str, silent))}: stuck outside the collective?)"
    return text


def bad_input(exc: BaseException) -> ConfigError | None:
    """The ConfigError that failed the worker group when every rank that failed of itself (not a
    peer's echo) raised one, the lowest rank's: bad input only the ranks could tell (a pipeline's
    build refusing its config), said by the driver as before the start (one line, exit 2). None
    otherwise."""
    failures = getattr(exc, "worker_failures", None) or {}
    causes = [err for _, err in sorted(failures.items()) if not is_echo(err)]
    return causes[0] if causes and all(isinstance(err, ConfigError) for err in causes) else None


def _one_line(err: BaseException) -> str:
    """An exception's message as one line: gloo's C++ source location and colour codes removed,
    a message of several lines cut to its first (the whole of it is in the library log)."""
    lines = logs.strip_colour(str(err)).strip().splitlines() or [""]
    return _SOURCE_LOCATION.sub("", lines[0]) + (" (the rest in the library log)" if len(lines) > 1 else "")
