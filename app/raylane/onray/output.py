"""What Ray prints, sent through raylane's handlers (raylane.logs): Ray's and Ray Data's own
console handlers removed, and the lines the raylets push to a driver logged rather than printed.
The ground floor (raylane.logs) knows nothing of Ray; these hooks run once Ray is imported, for as
long as the terminal is set up (the whole command, or an API call's `scope`).

Ray itself is not imported here: each hook waits for Ray's own import (raylane.logs.after_import)."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from raylane import logs


def install() -> None:
    """Ray's and Ray Data's output to the root logger, once each is imported (now, if it already
    is). Called right after the terminal is set up, before Ray is imported: by the command after
    `logs.setup`, by an API call through `scope`. With --verbose, nothing: the libraries print
    as they do."""
    if logs.verbose():
        return
    logs.after_import("ray", _ray_to_root)
    logs.after_import("ray.data", _ray_data_to_root)


@contextlib.contextmanager
def scope(verbose_flag: bool | None, command: str) -> Iterator[None]:
    """`logs.scope` for an API call, with Ray's output hooks installed when the scope set up the
    terminal (not inside the command, nor inside another call); undone with it."""
    with logs.scope(verbose_flag, command) as set_up:
        if set_up:
            install()
        yield


def _ray_to_root() -> None:
    # Ray's package import gives its "ray" logger a stderr handler of its own: its warnings (the
    # token-authentication notice) then bypass raylane's handlers.
    ray_logger = logging.getLogger("ray")
    logs.keep_logger(ray_logger)  # and its level, which ray.init sets
    ray_logger.handlers.clear()
    ray_logger.propagate = True
    # A driver prints what the raylets push to it (a worker start-up warning, a worker's death)
    # with print_to_stdstream, whatever log_to_driver says. The workers' own output is already
    # not relayed (raylane.onray.cluster), so what still comes this way is that channel.
    from raylane.onray.internals import ray_worker as worker

    if hasattr(worker, "print_to_stdstream"):
        printer = worker.print_to_stdstream
        worker.print_to_stdstream = _ray_lines_to_root
        logs.undone(lambda: setattr(worker, "print_to_stdstream", printer))


def _ray_data_to_root() -> None:
    # Ray Data's import gives its "ray.data" logger a console handler and stops it propagating:
    # its lines ("Progress bars disabled", "Dataset ... execution finished") reached the terminal.
    # Its session-file handler stays; the console's goes, and the records reach raylane's.
    data_logger = logging.getLogger("ray.data")
    logs.keep_logger(data_logger)
    for handler in [
        h
        for h in data_logger.handlers
        if type(h) is not logging.FileHandler
        and getattr(h, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    ]:
        data_logger.removeHandler(handler)
    data_logger.propagate = True


def _ray_lines_to_root(data: dict, ignore_prefix: bool = False) -> None:
    log = logging.getLogger("ray.driver_output")
    for line in data.get("lines") or []:
        log.warning("(%s) %s", data.get("pid", "ray"), line)
