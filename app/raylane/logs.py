"""What reaches the terminal. By default raylane's own lines, warnings and errors; what Ray, MLflow,
Tune and torch say goes to a log file of this process instead (Ray also keeps its own files in its
session folder). `--verbose` shows everything as the libraries print it.

Set up once, first thing in the `raylane` command, before any of those libraries is imported:
two of them configure their loggers at import, and Ray's workers and Tune's trials inherit the
environment set here."""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

VERBOSE_ENV = "RAYLANE_VERBOSE"
LOG_DIR = "logs"
KEEP_LOGS = 100  # the newest of a machine's log files; older ones go when a new one is made
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TRACEBACK_LOGGER = "traceback"

_log_file: Path | None = None


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def log_file() -> Path | None:
    """The file the libraries' messages went to, once one was written (None before, or verbose)."""
    return _log_file if _log_file is not None and _log_file.exists() else None


def record_traceback(what: str, text: str) -> None:
    """A failure's full traceback, which the terminal shows as one line: into the log file (and
    with --verbose, onto the terminal). Under a logger outside raylane's own, which the console
    leaves out by default; colour codes (a Ray task's traceback) removed."""
    from raylane.loop.baddata import strip_colour

    logging.getLogger(TRACEBACK_LOGGER).log(
        logging.WARNING if verbose() else logging.INFO, "%s\n%s", what, strip_colour(text).rstrip()
    )


def setup(verbose_flag: bool | None, command: str) -> None:
    """`verbose_flag` None: inherited (RAYLANE_VERBOSE), as in a Ray job `raylane submit` started."""
    on = verbose() if verbose_flag is None else verbose_flag
    os.environ[VERBOSE_ENV] = "1" if on else "0"
    # Read at import, by this process and by the Ray workers and trials that inherit them: no
    # worker output relayed to this terminal, and MLflow's loggers left to the root logger.
    os.environ["RAY_LOG_TO_DRIVER"] = "1" if on else "0"
    os.environ["MLFLOW_CONFIGURE_LOGGING"] = "true" if on else "false"
    # Tune's new output engine prints its boxes and TensorBoard hint at any verbosity; its legacy
    # one prints nothing at the verbosity 0 raylane asks for.
    os.environ["RAY_AIR_NEW_OUTPUT"] = "1" if on else "0"
    # MLflow writes "View run ... at" links to stdout when a run on a server ends (a trial's);
    # raylane prints the UI link itself.
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "false" if on else "true"
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, (_Console, _LazyFileHandler))]:
        root.removeHandler(handler)  # set up again in the same process (tests call the CLI's main)
        handler.close()
    console = _Console()
    console.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("raylane").setLevel(logging.INFO)
    if on:
        root.setLevel(logging.WARNING)  # libraries keep the handlers they set up themselves
        root.addHandler(console)
        return
    console.addFilter(_own_or_error)
    console.setFormatter(_ConsoleFormatter())
    root.setLevel(logging.INFO)
    root.addHandler(console)
    root.addHandler(_file_handler(command))
    logging.captureWarnings(True)  # torch's and the others' warnings: to the file, through the root
    for name in ("alembic", "sqlalchemy.engine"):  # MLflow's own set-up keeps these quiet too
        logging.getLogger(name).setLevel(logging.WARNING)
    _after_import("ray", _ray_to_root)
    _after_import("ray.data", _ray_data_to_root)
    _after_import("torch", _torch_to_root)
    _after_import("mlflow", _mlflow_prints_to_root)


class _Console(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record, not as it was at set-up (a test's capture)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _own(record: logging.LogRecord) -> bool:
    return record.name == "raylane" or record.name.startswith("raylane.")


def _own_or_error(record: logging.LogRecord) -> bool:
    return _own(record) or record.levelno >= logging.ERROR


class _ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if _own(record) else f"{record.name}: {text}"  # whose error, since not raylane's


def _file_handler(command: str) -> logging.Handler:
    global _log_file
    from raylane.onray.localcluster import home  # no Ray import there

    folder = home() / LOG_DIR
    _log_file = folder / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    return _LazyFileHandler(_log_file)


class _LazyFileHandler(logging.Handler):
    """A file handler that creates its folder and file only once something is logged: a run with
    nothing to say leaves no file behind."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        self.path = path
        self.setFormatter(logging.Formatter(_FILE_FORMAT))
        self._inner: logging.FileHandler | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if self._inner is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                _prune(self.path.parent)
                self._inner = logging.FileHandler(self.path, encoding="utf-8")
                self._inner.setFormatter(self.formatter)
            self._inner.emit(record)
        except OSError:
            self.handleError(record)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        super().close()


def _prune(folder: Path) -> None:
    try:
        files = sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime)
        for old in files[: max(len(files) - KEEP_LOGS + 1, 0)]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # another process pruned at the same time


def _ray_to_root() -> None:
    # Ray's package import gives its "ray" logger a stderr handler of its own: its warnings (the
    # token-authentication notice) then bypass the handlers above.
    ray_logger = logging.getLogger("ray")
    ray_logger.handlers.clear()
    ray_logger.propagate = True
    # A driver prints what the raylets push to it (a worker start-up warning, a worker's death)
    # with print_to_stdstream, whatever log_to_driver says. The workers' own output is already
    # not relayed (RAY_LOG_TO_DRIVER=0), so what still comes this way is that channel.
    from raylane.onray.internals import ray_worker as worker

    if hasattr(worker, "print_to_stdstream"):
        worker.print_to_stdstream = _ray_lines_to_root


def _ray_data_to_root() -> None:
    # Ray Data's import gives its "ray.data" logger a console handler and stops it propagating:
    # its lines ("Progress bars disabled", "Dataset ... execution finished") reached the terminal.
    # Its session-file handler stays; the console's goes, and the records reach ours.
    data_logger = logging.getLogger("ray.data")
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


def _mlflow_prints_to_root() -> None:
    # MLflow prints some notices without a logger ("Successfully registered model ...", through
    # eprint and its stream): they become records of the "mlflow" logger, for the log file.
    from mlflow.utils import logging_utils

    log = logging.getLogger("mlflow")
    # Where MLflow configured its loggers already (imported before this set-up, with its own
    # logging on), their handler writes to that stream: records would go round in a loop.
    for handler in [h for h in log.handlers if getattr(h, "stream", None) is logging_utils.MLFLOW_LOGGING_STREAM]:
        log.removeHandler(handler)
        log.propagate = True

    def write(text: str) -> None:
        for line in text.splitlines():
            if line.strip():
                log.info(line)

    logging_utils.MLFLOW_LOGGING_STREAM.write = write
    logging_utils.MLFLOW_LOGGING_STREAM.flush = lambda: None


def _torch_to_root() -> None:
    # torch's import gives each of its registered loggers (torch.export's among them) a stderr
    # handler of its own and stops propagation. Its trace log, a file when asked for, stays.
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (
            (name == "torch" or name.startswith("torch."))
            and name != "torch.__trace"
            and isinstance(logger, logging.Logger)
        ):
            for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
                logger.removeHandler(handler)
            logger.propagate = True


def _after_import(name: str, then: Callable[[], None]) -> None:
    """Call `then` once the top-level module `name` has been imported (now, if it already is)."""
    if name in sys.modules:
        then()
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            run_module = spec.loader.exec_module

            def exec_module(module) -> None:
                run_module(module)
                then()

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())
