"""What reaches the terminal. By default raylane's own lines, warnings and errors; what Ray, MLflow,
Tune and torch say goes to a log file of this process instead (Ray also keeps its own files in its
session folder). `--verbose` shows everything as the libraries print it.

Set up once, first thing in the `raylane` command, before any of those libraries is imported:
two of them configure their loggers at import, and Ray's workers and Tune's trials inherit the
environment set here. A call of the Python API (`raylane.train()`, ...) does the same for the
call only (`scope`): a notebook's or script's own logging is as it was once the call returns.
Ray's output is sent the same way by raylane.onray.output, which the command and the API's calls
install on top: this module imports nothing of Ray, the loop or the cluster code."""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from raylane.paths import home

VERBOSE_ENV = "RAYLANE_VERBOSE"
LOG_DIR = "logs"
KEEP_LOGS = 100  # the newest of a machine's log files; older ones go when a new one is made
_FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TRACEBACK_LOGGER = "traceback"
_COLOUR = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

_log_file: Path | None = None
# Set by `setup` (the command's, for the whole process); while an API call's `scope` is set up
# instead, what undoes each change it made, in the order made.
_process_wide = False
_undo: list[Callable[[], None]] | None = None


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def log_file() -> Path | None:
    """The file the libraries' messages went to, once one was written (None before, or verbose)."""
    return _log_file if _log_file is not None and _log_file.exists() else None


def strip_colour(text: str) -> str:
    """`text` without its terminal colour codes (a Ray task's traceback comes in colour)."""
    return _COLOUR.sub("", text)


def record_traceback(what: str, text: str) -> None:
    """A failure's full traceback, which the terminal shows as one line: into the log file (and
    with --verbose, onto the terminal). Under a logger outside raylane's own, which the console
    leaves out by default; colour codes (a Ray task's traceback) removed."""
    logging.getLogger(TRACEBACK_LOGGER).log(
        logging.WARNING if verbose() else logging.INFO, "%s\n%s", what, strip_colour(text).rstrip()
    )


def setup(verbose_flag: bool | None, command: str) -> None:
    """For the whole process (the `raylane` command). `verbose_flag` None: inherited
    (RAYLANE_VERBOSE), as in a Ray job `raylane submit` started."""
    global _process_wide
    _process_wide = True
    on = verbose() if verbose_flag is None else verbose_flag
    # Read at import, by this process and by the Ray workers and trials that inherit them: no
    # worker output relayed to this terminal, and MLflow's loggers left to the root logger.
    os.environ["RAY_LOG_TO_DRIVER"] = "1" if on else "0"
    os.environ["MLFLOW_CONFIGURE_LOGGING"] = "true" if on else "false"
    _configure(on, command)


@contextlib.contextmanager
def scope(verbose_flag: bool | None, command: str) -> Iterator[bool]:
    """A call of the Python API: what the terminal shows is what the command shows, and the rest
    goes to a library log of the call's own, until the call returns. Then everything changed here
    is as it was: the environment, the root logger's handlers and level (a notebook's own are set
    aside meanwhile), the libraries' loggers and Python's warnings. Inside the command (its own
    `setup`), or inside another call's scope, nothing more is done. Yields whether this scope set
    the terminal up (what a caller adds, raylane.onray.output's hooks, is undone with it)."""
    global _undo
    if _process_wide or _undo is not None:
        yield False
        return
    _undo = []
    try:
        # Unlike the command's, Ray's and MLflow's read-at-import settings stay as they are: a
        # library imported during the call must not keep them after it (raylane.onray.cluster
        # tells ray.init itself whether to relay the workers' output).
        _configure(verbose() if verbose_flag is None else verbose_flag, command)
        yield True
    finally:
        undo, _undo = _undo, None
        for step in reversed(undo):
            step()


def _configure(on: bool, command: str) -> None:
    _set_env(VERBOSE_ENV, "1" if on else "0")
    # Tune's new output engine prints its boxes and TensorBoard hint at any verbosity; its legacy
    # one prints nothing at the verbosity 0 raylane asks for.
    _set_env("RAY_AIR_NEW_OUTPUT", "1" if on else "0")
    # MLflow writes "View run ... at" links to stdout when a run on a server ends (a trial's);
    # raylane prints the UI link itself.
    _set_env("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "false" if on else "true")
    root = logging.getLogger()
    keep_logger(root)
    for handler in [h for h in root.handlers if isinstance(h, (_Console, _LazyFileHandler))]:
        root.removeHandler(handler)  # set up again in the same process (tests call the CLI's main)
        handler.close()
    if _undo is not None:
        # A notebook's handlers would print every library's records, and raylane's twice.
        for theirs in list(root.handlers):
            root.removeHandler(theirs)
    console = _Console()
    console.setFormatter(logging.Formatter("%(message)s"))
    keep_logger(logging.getLogger("raylane"))
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
    _capture_warnings()  # torch's and the others' warnings: to the file, through the root
    for name in ("alembic", "sqlalchemy.engine"):  # MLflow's own set-up keeps these quiet too
        keep_logger(logging.getLogger(name))
        logging.getLogger(name).setLevel(logging.WARNING)
    # Ray's output goes the same way through raylane.onray.output.install, which its callers
    # (the command, an API call's scope) add: this floor does not know Ray.
    after_import("torch", _torch_to_root)
    after_import("mlflow", _mlflow_prints_to_root)


def undone(step: Callable[[], None]) -> None:
    """Register what undoes a change just made, when an API call's scope is set up (under the
    command's `setup` the change stays for the whole process)."""
    if _undo is not None:
        _undo.append(step)


def _set_env(key: str, value: str) -> None:
    previous = os.environ.get(key)
    os.environ[key] = value

    def restore() -> None:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous

    undone(restore)


def keep_logger(logger: logging.Logger) -> None:
    """What a change to `logger` (its handlers, propagation, level) is undone to."""
    handlers, propagate, level = list(logger.handlers), logger.propagate, logger.level

    def restore() -> None:
        for handler in [h for h in logger.handlers if h not in handlers]:
            logger.removeHandler(handler)
            if isinstance(handler, (_Console, _LazyFileHandler)):
                handler.close()
        for handler in [h for h in handlers if h not in logger.handlers]:
            logger.addHandler(handler)
        logger.propagate, logger.level = propagate, level

    undone(restore)


def _capture_warnings() -> None:
    """Python's warnings to the "py.warnings" logger, as logging.captureWarnings(True) sends them,
    but installed every time: captureWarnings does nothing when it believes it is on already,
    though another hand (a test runner's catch_warnings, a notebook) may have put its own
    showwarning back since."""
    import warnings

    saved = warnings.showwarning
    warnings.showwarning = _warning_to_log
    undone(lambda: setattr(warnings, "showwarning", saved))


def _warning_to_log(message, category, filename, lineno, file=None, line=None) -> None:
    import warnings

    if file is not None:  # written where its caller asked (warnings.showwarning's contract)
        file.write(warnings.formatwarning(message, category, filename, lineno, line))
        return
    logging.getLogger("py.warnings").warning("%s", warnings.formatwarning(message, category, filename, lineno, line))


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


def _mlflow_prints_to_root() -> None:
    # MLflow prints some notices without a logger ("Successfully registered model ...", through
    # eprint and its stream): they become records of the "mlflow" logger, for the log file.
    from mlflow.utils import logging_utils

    log = logging.getLogger("mlflow")
    keep_logger(log)
    # Where MLflow configured its loggers already (imported before this set-up, with its own
    # logging on), their handler writes to that stream: records would go round in a loop.
    for handler in [h for h in log.handlers if getattr(h, "stream", None) is logging_utils.MLFLOW_LOGGING_STREAM]:
        log.removeHandler(handler)
        log.propagate = True

    def write(text: str) -> None:
        for line in text.splitlines():
            if line.strip():
                log.info(line)

    stream = logging_utils.MLFLOW_LOGGING_STREAM
    own = {k: stream.__dict__[k] for k in ("write", "flush") if k in stream.__dict__}
    stream.write = write
    stream.flush = lambda: None

    def restore() -> None:
        for key in ("write", "flush"):
            if key in own:
                setattr(stream, key, own[key])
            else:
                stream.__dict__.pop(key, None)

    undone(restore)


def _torch_to_root() -> None:
    # torch's import gives each of its registered loggers (torch.export's among them) a stderr
    # handler of its own and stops propagation. Its trace log, a file when asked for, stays.
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if (
            (name == "torch" or name.startswith("torch."))
            and name != "torch.__trace"
            and isinstance(logger, logging.Logger)
        ):
            keep_logger(logger)
            for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
                logger.removeHandler(handler)
            logger.propagate = True


def after_import(name: str, then: Callable[[], None]) -> None:
    """Call `then` once the module `name` has been imported (now, if it already is): a library's
    own logging set-up, done at its import, is undone right after it. Within an API call's scope,
    a module the call did not import is not waited for after it."""
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

    finder = Finder()
    sys.meta_path.insert(0, finder)

    def forget() -> None:  # the call ended before the module was imported
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)

    undone(forget)
