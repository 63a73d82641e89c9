"""What a config's `pipeline:` names: a shipped pipeline (`digits`), a dotted module
(`my_project.pipes.resnet`) or a Python file (`./pipes/resnet.py`), and how every process of a
run finds it.

A reference is normalized once, where the config file's directory is known (`normalize`): a file
becomes its absolute path; a dotted module found under the config's directory or the working
directory makes that directory a *root*. Roots go first on `sys.path` in this process and, through
RAYLANE_PIPELINE_ROOTS, in Ray's workers (`worker_environment`, `joined_runtime_env`), where Ray
would otherwise put the driver's working directory first and a user's `app/` could be found in the
wrong place. Every mistake, including an exception while importing the user's module, is a
ConfigError of one line. No torch or Ray is imported here.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from raylane.errors import ConfigError, RaylaneError

SHIPPED: dict[str, str] = {
    "regression": "raylane.pipelines.regression",
    "digits": "raylane.pipelines.digits",
    "gpt": "raylane.pipelines.gpt",
    "tabular": "raylane.pipelines.tabular",
    "text": "raylane.pipelines.text",
    "hf": "raylane.pipelines.hf",
}
ROOTS_ENV = "RAYLANE_PIPELINE_ROOTS"
FILE_MODULE_PREFIX = "raylane_pipeline_file_"
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

_roots: list[str] = []  # this process's roots, in sys.path order
_loaded: dict[str, ModuleType] = {}


class UserCodeError(RaylaneError, RuntimeError):
    """The user's pipeline code raised, or returned what its contract does not allow: one line
    naming the pipeline, the function, the exception and the user's innermost `file:line`."""


class PipelineBuildError(UserCodeError):
    """`build(cfg)` of a pipeline raised or returned no Pipeline; the message names the pipeline,
    the exception and where it was raised."""


def _config_error(text: str) -> Exception:
    return ConfigError(text)


def is_file_ref(ref: str) -> bool:
    return ref.endswith(".py") or "/" in ref or os.sep in ref


def label(ref: str) -> str:
    """A short name for run names: `digits`, `shapes` for `./pipelines/shapes.py` or `a.b.shapes`."""
    name = Path(ref).stem if is_file_ref(ref) else ref.rsplit(".", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-")[:64] or "pipeline"


def normalize(ref: Any, base_dirs: Iterable[str | Path]) -> str:
    """The reference as every process can use it; ConfigError when nothing matches it. Relative
    files and top-level packages are looked up in `base_dirs`, in order."""
    if not isinstance(ref, str) or not ref.strip():
        raise _config_error(f"pipeline = {ref!r}: {_expected()}")
    if ref in SHIPPED:
        return ref
    dirs = list(dict.fromkeys(Path(d).resolve() for d in base_dirs))
    if is_file_ref(ref):
        return _normalize_file(ref, dirs)
    if not _DOTTED.match(ref):
        raise _config_error(f"pipeline = {ref!r}: {_expected()}")
    top = ref.split(".", 1)[0]
    for d in [Path(r) for r in roots()] + dirs:  # roots known already first (on a Ray worker)
        if (d / top).is_dir() or (d / f"{top}.py").is_file():
            add_root(d)
            return ref
    if _find_spec(top) is not None:
        return ref  # an installed package
    close = difflib.get_close_matches(ref, list(SHIPPED), n=1) if "." not in ref else []
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = ", ".join(str(d) for d in dirs)
    raise _config_error(
        f"pipeline = {ref!r}: unknown pipeline: {hint}no shipped pipeline of that name, and no "
        f"module {top!r} in {where} or installed ({_expected()})"
    )


def _normalize_file(ref: str, dirs: list[Path]) -> str:
    path = Path(ref).expanduser()
    bases: list[Path | None] = [None] if path.is_absolute() else list(dirs)
    candidates = [path] if path.is_absolute() else [d / path for d in dirs]
    for base, candidate in zip(bases, candidates, strict=True):
        if candidate.is_file():
            found = candidate.resolve()
            if any(found.is_relative_to(r) for r in roots()):
                base = None  # normalized before (a Ray worker, a second validation): roots known
            elif base is None and dirs and found.is_relative_to(dirs[0]):
                base = dirs[0]  # an absolute path in a config: its directory is the project's
            for root in ([base] if base else []) + [found.parent]:
                add_root(root)
            return str(found)
    if path.is_absolute() and _relocate(path):
        return ref  # a Ray worker on another node: the file came with the run (py_modules)
    # A path with a control character (a form feed, a newline) quoted: it would break the one line.
    looked = ", ".join(str(c) if str(c).isprintable() else repr(str(c)) for c in candidates)
    raise _config_error(f"pipeline = {ref!r}: no such file (looked for {looked})")


def _expected() -> str:
    return f"expected a shipped pipeline ({', '.join(sorted(SHIPPED))}), a dotted module path or a .py file"


def _find_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def add_root(path: str | Path) -> None:
    """Put a directory of the user's code first on sys.path (after roots added before it)."""
    root = str(Path(path).resolve())
    if root not in _roots:
        _roots.append(root)
    _front(roots())


def _front(paths: list[str]) -> None:
    for i, p in enumerate(paths):
        while p in sys.path:
            sys.path.remove(p)
        sys.path.insert(i, p)


def roots() -> list[str]:
    """This process's roots and those it inherited (RAYLANE_PIPELINE_ROOTS) that exist here."""
    inherited = [p for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p]
    # Inherited first: on a Ray worker whose working directory is the driver's, a root found
    # there must not come before the driver's own roots.
    return [p for p in dict.fromkeys(inherited + _roots) if Path(p).is_dir()]


def load(ref: str) -> ModuleType:
    """The pipeline module (normalized `ref`), imported once per process and checked."""
    if ref in _loaded:
        return _loaded[ref]
    _front(roots())  # ahead of the driver's working directory, which Ray puts first on a worker
    if ref in SHIPPED:
        module = importlib.import_module(SHIPPED[ref])
    elif is_file_ref(ref):
        module = _load_file(ref)
    else:
        module = _import_module(ref)
    _check_contract(ref, module)
    _loaded[ref] = module
    register_for_pickling()
    return module


@dataclass(frozen=True)
class Resolved:
    """A config's pipeline, looked up once for a launch (`resolve`) and handed to what asks about
    it (the layout checks, the global batch's, the Ray launcher), rather than each looking it up
    again by its reference."""

    ref: str
    module: ModuleType

    @property
    def label(self) -> str:
        return label(self.ref)

    @property
    def streams(self) -> bool:
        """Its module declares `sources(cfg)`, a dict of FileSource by dataset name ("train",
        "eval"), which the Ray driver turns into Ray Data without building the model (without it,
        a FileSource from build() is read by each rank: raylane.loop.data.streaming)."""
        return callable(getattr(self.module, "sources", None))


def resolve(ref: str) -> Resolved:
    """The pipeline `ref` (normalized) names, imported once per process (`load`)."""
    return Resolved(ref, load(ref))


def _load_file(ref: str) -> ModuleType:
    path = Path(ref)
    if not path.is_file():
        path = _relocate(path) or path
    # A stable name, the same in every process: Ray pickles the module's functions by value.
    digest = hashlib.sha1(ref.encode()).hexdigest()[:10]
    name = f"{FILE_MODULE_PREFIX}{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise _config_error(f"pipeline = {ref!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of the user's import is one ConfigError
        del sys.modules[name]
        raise _config_error(_import_failure(ref, exc, path)) from None
    return module


def _import_module(ref: str) -> ModuleType:
    try:
        return importlib.import_module(ref)
    except ModuleNotFoundError as exc:
        if exc.name and (ref == exc.name or ref.startswith(exc.name + ".")):
            searched = ", ".join(roots()) or "the installed packages"
            raise _config_error(
                f"pipeline = {ref!r}: no module named {exc.name!r} (searched {searched} and the installed packages)"
            ) from None
        raise _config_error(_import_failure(ref, exc)) from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of the user's import is one ConfigError
        raise _config_error(_import_failure(ref, exc)) from None


def _import_failure(ref: str, exc: BaseException, path: Path | None = None) -> str:
    kind = type(exc).__name__
    if isinstance(exc, SyntaxError):
        where, text = f"{exc.filename}:{exc.lineno}", exc.msg
    else:
        where, text = _raised_at(exc, path), str(exc)
    text = " ".join(text.split())  # one line
    return f"pipeline = {ref!r}: importing it raised {kind}: {text} (at {where})"


def _raised_at(exc: BaseException, path: Path | None) -> str:
    """file:line where `exc` was raised: the innermost frame in the user's code (the pipeline file
    or under a root), else the innermost frame that is not the import machinery's."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    if not frames:
        return "unknown location"
    return user_frame(exc, [str(path.resolve())] if path else []) or f"{frames[-1].filename}:{frames[-1].lineno}"


_OWN_DIR = str(Path(__file__).resolve().parent) + os.sep  # raylane's own code: never the user's
_LIBRARIES = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def is_user_file(filename: str, files: Iterable[str] = ()) -> bool:
    """Whether code in `filename` is the user's: one of `files` (a pipeline module's own, shipped
    ones included), or under a root, and neither an installed library nor raylane."""
    if filename in files:
        return True
    if filename.startswith(("<", _OWN_DIR)) or any(lib in filename for lib in _LIBRARIES):
        return False
    return any(filename.startswith(root + os.sep) for root in roots())


def user_frame(exc: BaseException, files: Iterable[str] = ()) -> str | None:
    """`file:line` of the innermost frame of `exc`'s traceback in the user's code (see
    is_user_file), or None."""
    files = set(files)
    found = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        if is_user_file(frame.f_code.co_filename, files):
            found = f"{frame.f_code.co_filename}:{line}"
    return found


CONTRACT = "a pipeline module defines Config (a raylane.BaseConfig subclass with a `model` section) and build(cfg)"


def _check_contract(ref: str, module: ModuleType) -> None:
    """What a module must define; that its Config is a BaseConfig, raylane.config checks."""
    where = f"pipeline = {ref!r}"
    if getattr(module, "Config", None) is None:
        raise _config_error(f"{where}: the module defines no Config class ({CONTRACT})")
    if not callable(getattr(module, "build", None)):
        raise _config_error(f"{where}: the module defines no build(cfg) function ({CONTRACT})")


def sources(cfg: Any) -> dict[str, Any]:
    """`sources(cfg)` of the config's pipeline (a streaming one), its exception named as build's."""
    found = call(cfg, load(cfg.pipeline), "sources")
    if not isinstance(found, dict):
        raise UserCodeError(
            f"pipeline {cfg.pipeline!r}: sources(cfg) returned {type(found).__name__}, not a dict "
            f"of raylane.FileSource by data set name (at {returned_at(load(cfg.pipeline).sources)})"
        )
    return found


def call(cfg: Any, module: ModuleType, name: str) -> Any:
    """`name(cfg)` of a pipeline module, its exception one line naming the function and the place;
    a DataError or ConfigError (bad data, bad input: not the code's fault) stays one of its own."""
    from raylane.errors import DataError

    try:
        return getattr(module, name)(cfg)
    except DataError:  # bad data, already one line naming its place: not the pipeline's code's fault
        raise
    except ConfigError as exc:  # bad input only build could tell (raylane.hf.pipeline refusing a data.mix)
        said = bad_input(exc)
        if said is exc:
            raise
        raise said from exc
    except Exception as exc:
        text = " ".join(str(exc).split())
        error = PipelineBuildError if name == "build" else UserCodeError
        raise error(
            f"pipeline {cfg.pipeline!r}: {name}(cfg) raised {type(exc).__name__}: {text} "
            f"(at {_raised_at(exc, Path(getattr(module, '__file__', '') or '.'))})"
        ) from exc


def bad_input(exc: ConfigError) -> ConfigError:
    """A ConfigError a pipeline's function raised, as the config's own checks say theirs (one line,
    `invalid config: <field> = <value>: ...`): the run ends in it, exit 2, not as the code's fault."""
    text = " ".join(str(exc).split())
    return exc if text == str(exc) and text.startswith("invalid ") else ConfigError(f"invalid config: {text}")


def returned_at(fn: Any) -> str:
    """`file:line` of a function's return statement when it has exactly one, else of its
    definition: where a wrong return value came from (read from its source: nothing runs)."""
    import ast
    import inspect
    import textwrap

    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return getattr(fn, "__qualname__", repr(fn))
    line = code.co_firstlineno
    try:
        source, start = inspect.getsourcelines(fn)
        body = ast.parse(textwrap.dedent("".join(source))).body[0]
        returns = [node for node in _own_nodes(body) if isinstance(node, ast.Return)]
        if len(returns) == 1:
            line = start + returns[0].lineno - 1
    except (OSError, TypeError, SyntaxError, IndexError):
        pass  # no source (a lambda inside an expression, an interactive session): the definition
    return f"{code.co_filename}:{line}"


def _own_nodes(node: Any) -> Iterable[Any]:
    """The nodes of a function's body, not those of functions or classes defined in it."""
    import ast

    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from _own_nodes(child)


def _relocate(path: Path) -> Path | None:
    """Where a file of an inherited root is on this node when the root itself is not: its path
    below the root, under one of sys.path's entries (Ray unpacks py_modules there)."""
    inherited = [p for p in os.environ.get(ROOTS_ENV, "").split(os.pathsep) if p]
    for root in inherited:
        if path.is_relative_to(root):
            below = path.relative_to(root)
            for entry in sys.path:
                if entry and (Path(entry) / below).is_file():
                    return Path(entry) / below
    return None


def user_modules() -> dict[str, Path]:
    """The user's top-level modules loaded here (pipeline files, and packages or modules under a
    root) -> the directory or file that holds each, below its outermost root."""
    found: dict[str, Path] = {}
    # Strings, not Paths: this scans every loaded module (thousands, with torch) against every
    # root at each pipeline load; a process that loads many pipelines (a test session) has many
    # roots, and building Paths for each pair took seconds a load.
    mine = [os.path.join(root, "") for root in roots()]
    prefixes = tuple(mine)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        top = name.split(".", 1)[0]
        if not isinstance(file, str) or top in found or top == "raylane":
            continue
        if name.startswith(FILE_MODULE_PREFIX):
            root = next((r for r in mine if file.startswith(r)), None)
            found[name] = Path(root, file[len(root) :].split(os.sep, 1)[0]) if root else Path(file)
            continue
        if not file.startswith(prefixes):
            continue
        for root in mine:
            single, package = f"{root}{top}.py", f"{root}{top}{os.sep}"
            if file == single or file.startswith(package):
                found[top] = Path(single) if file == single else Path(package)
                break
    return found


def register_for_pickling() -> None:
    """Ray pickles functions of the user's modules by value (a Ray Data transform defined in a
    pipeline file reaches workers that cannot import it by name). Only where Ray is loaded."""
    pickler = sys.modules.get("ray.cloudpickle")
    if pickler is None:
        return
    for name in user_modules():
        if name in sys.modules:
            pickler.register_pickle_by_value(sys.modules[name])


def worker_environment() -> None:
    """For an embedded Ray cluster started after this: its workers inherit the roots."""
    mine = roots()
    if not mine:
        return
    os.environ[ROOTS_ENV] = os.pathsep.join(mine)
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in mine]
    os.environ["PYTHONPATH"] = os.pathsep.join(mine + old)


def joined_runtime_env(in_job: bool) -> dict[str, Any]:
    """The runtime_env for joining a cluster: the roots, and, unless this driver runs in a Ray job
    (whose working_dir already ships the code), the user's modules as py_modules."""
    mine = roots()
    if not mine:
        return {}
    env: dict[str, Any] = {"env_vars": {ROOTS_ENV: os.pathsep.join(mine)}}
    if not in_job:
        env["py_modules"] = ship_paths()
        env["excludes"] = ["**/__pycache__", "*.pyc"]
    return env


def ship_paths() -> list[str]:
    """What py_modules uploads: each user module's top-level directory or file."""
    return sorted({str(p) for p in user_modules().values()})
