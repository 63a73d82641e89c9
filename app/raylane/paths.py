"""Config keys that hold paths, resolved once, on the driver, before any worker sees them.

A config field declares that it holds a path by its type: `raylane.InputPath` (a file, folder or
glob that must exist: data, a checkpoint to start from), `raylane.InputPaths` (one or a list of
them) or `raylane.OutputPath` (a folder the run writes: `run.storage_path`). Ray's workers, a
`raylane up` head's processes and Ray Data's read tasks do not run in the driver's working
directory, so a relative path that the driver's check found would name nothing there; every such
path is made absolute here instead:

- an input written in a config file is relative to that file's folder, as `pipeline:` is (a
  shipped config, named like `tabular`, is a template: its inputs are relative to the working
  directory);
- everything else, `--set` values, a mapping given to the Python API, outputs and defaults, is
  relative to the working directory, where the command runs and where MLflow's default store
  (`mlflow.db`) is: a run's `runs/` stays beside it.

A URI (`s3://bucket/prefix`) is left as it is, and `~` is expanded. Nothing here imports torch
or Ray."""

from __future__ import annotations

import glob
import os
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel


class PathValue:
    """The marker in a path field's type. `must_exist`: an input, checked before the run starts
    (the check is skipped for URIs, whose reader checks them)."""

    __slots__ = ("must_exist", "hub_id")

    def __init__(self, *, must_exist: bool = True, hub_id: bool = False) -> None:
        self.must_exist = must_exist
        self.hub_id = hub_id

    def __repr__(self) -> str:
        return f"PathValue(must_exist={self.must_exist}, hub_id={self.hub_id})"


InputPath = Annotated[str, PathValue()]
InputPaths = Annotated[str | list[str], PathValue()]
OutputPath = Annotated[str, PathValue(must_exist=False)]
# A Hugging Face model or tokenizer: a folder, or a hub id (`gpt2`, `org/name`) where no folder
# of that name is; the id is kept as written (raylane.hf.hub resolves it).
ModelPath = Annotated[str, PathValue(hub_id=True)]

# huggingface_hub's rule for a repository id: `name` or `namespace/name`, of letters, digits,
# `-`, `_` and `.`, no `--` or `..`, at most 96 characters.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")


def home() -> Path:
    """raylane's own folder on this machine (`$RAYLANE_HOME`, default `~/.raylane`): the library
    logs, the `raylane up` head's record, the embedded clusters' records."""
    return Path(os.environ.get("RAYLANE_HOME") or Path.home() / ".raylane").expanduser()


def is_uri(value: str) -> bool:
    return "://" in value


def is_hub_id(value: str) -> bool:
    """`value` reads as a Hugging Face hub id (`gpt2`, `org/name`), not as a path (`./x`, `/x`, `~`)."""
    return (
        len(value) <= 96
        and bool(_HUB_ID.fullmatch(value))
        and "--" not in value
        and ".." not in value
        and not value.endswith((".", ".git"))
    )


def absolute(value: str, base: Path) -> str:
    """`value` as an absolute local path (a glob stays a glob), or as it is when it is a URI."""
    if not value or is_uri(value):
        return value
    expanded = os.path.expanduser(value)
    return expanded if os.path.isabs(expanded) else os.path.normpath(os.path.join(base, expanded))


def quick_filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, path inside it) for a URI, for a check before the run: on S3
    without the SDK's retries with backoff, so that an endpoint that refuses fails at once (~9 s
    with them) and one that does not answer fails within seconds."""
    import pyarrow.fs as pafs

    fs, root = pafs.FileSystem.from_uri(uri)
    if isinstance(fs, pafs.S3FileSystem) and "?" not in uri:  # a URI's own options are kept as they are
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        fs = pafs.S3FileSystem(
            region=fs.region,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2),
            connect_timeout=3,
            request_timeout=5,
            **({"endpoint_override": endpoint} if endpoint else {}),
        )
    return fs, root


def path_keys(model: type[BaseModel], prefix: str = "") -> dict[str, PathValue]:
    """Dotted key -> marker, for every path field of `model` and its sections."""
    found: dict[str, PathValue] = {}
    for name, field in model.model_fields.items():
        marker = _marker([*field.metadata, field.annotation])
        if marker is not None:
            found[prefix + name] = marker
            continue
        for section in _sections(field.annotation):
            found.update(path_keys(section, f"{prefix}{name}."))
    return found


def _marker(candidates: list[Any]) -> PathValue | None:
    for item in candidates:
        if isinstance(item, PathValue):
            return item
        if typing.get_origin(item) is Annotated:
            found = _marker(list(item.__metadata__))
            if found is not None:
                return found
        args = typing.get_args(item)
        if args and typing.get_origin(item) is not Annotated:
            found = _marker(list(args))
            if found is not None:
                return found
    return None


def _sections(annotation: Any) -> Iterator[type[BaseModel]]:
    """The section models a field's type holds (itself, or the models of an Optional or a union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for arg in typing.get_args(annotation):
        yield from _sections(arg)


def resolve(
    raw: dict[str, Any], model: type[BaseModel], base: Path, *, inputs_only: bool = False, defaults: bool = False
) -> dict[str, Any]:
    """`raw` (a config as read, not validated) with the relative values of `model`'s path keys
    made absolute from `base`: all of them, or only inputs (`inputs_only`). With `defaults`, a
    path key left out whose default is a relative path gets that path, made absolute."""
    for key, marker in path_keys(model).items():
        if inputs_only and not marker.must_exist:
            continue
        *parents, leaf = key.split(".")
        default = _default(model, key) if defaults else None
        fill = isinstance(default, str) and bool(default) and _sections_exist(model, parents, raw)
        node: Any = raw
        for i, part in enumerate(parents):
            if isinstance(node, list):  # a list of sections (data.mix): each one's key
                for item in node:
                    _resolve_in(item, [*parents[i:], leaf], base, marker)
                break
            if not isinstance(node, dict):
                break
            if fill and part not in node:
                node[part] = {}
            node = node.get(part)
        else:
            if isinstance(node, list):
                for item in node:
                    _resolve_in(item, [leaf], base, marker)
                continue
            if not isinstance(node, dict):
                continue  # a section that is not a mapping: validation names it
            if fill and leaf not in node:
                node[leaf] = default
            _resolve_in(node, [leaf], base, marker)
    return raw


def _resolve_in(node: Any, parts: list[str], base: Path, marker: PathValue) -> None:
    """The path at `parts` under `node` made absolute, through any lists of sections on the way."""
    if isinstance(node, list):
        for item in node:
            _resolve_in(item, parts, base, marker)
        return
    if not isinstance(node, dict):
        return  # not a mapping: validation names it
    if len(parts) > 1:
        _resolve_in(node.get(parts[0]), parts[1:], base, marker)
        return
    value = node.get(parts[0])
    if isinstance(value, str):
        node[parts[0]] = _resolved(value, base, marker)
    elif isinstance(value, list):
        node[parts[0]] = [absolute(v, base) if isinstance(v, str) else v for v in value]


def _resolved(value: str, base: Path, marker: PathValue) -> str:
    path = absolute(value, base)
    if marker.hub_id and is_hub_id(value) and not os.path.exists(path):
        return value  # a hub id: no folder of that name here
    return path


def _sections_exist(model: type[BaseModel], parents: list[str], raw: dict[str, Any]) -> bool:
    """Every section on the way to a key is in `raw` or exists by default: an optional section
    left out (`extra: Extra | None = None`) stays out, rather than being made by its default path."""
    node: Any = raw
    for part in parents:
        field = model.model_fields[part]
        present = isinstance(node, dict) and part in node
        if not present and not field.is_required() and field.get_default(call_default_factory=True) is None:
            return False
        node = node.get(part) if isinstance(node, dict) else None
        sections = list(_sections(field.annotation))
        if not sections:
            return False
        model = sections[0]
    return True


def _default(model: type[BaseModel], key: str) -> Any:
    *parents, leaf = key.split(".")
    for part in parents:
        sections = list(_sections(model.model_fields[part].annotation))
        if not sections:
            return None
        model = sections[0]
    field = model.model_fields[leaf]
    return None if field.is_required() else field.get_default(call_default_factory=True)


def missing_inputs(cfg: Any) -> Iterator[tuple[str, str]]:
    """(dotted key, path) of every local input path of `cfg` that names nothing: no file or
    folder, and for a glob, no match."""
    flat = cfg.flat()
    for key, marker in path_keys(type(cfg)).items():
        if not marker.must_exist:
            continue
        value = flat.get(key)
        for path in value if isinstance(value, list) else [value]:
            if isinstance(path, str) and path and not is_uri(path) and not _names_something(path):
                yield key, path


def _names_something(path: str) -> bool:
    return Path(path).exists() or (glob.has_magic(path) and bool(glob.glob(path, recursive=True)))


_AWS_ERROR = re.compile(r"AWS Error (\w+) during \w+ operation: (?:curlCode: \d+, )?([^;]+)")


def one_line(exc: BaseException, limit: int = 240) -> str:
    """An exception's message as one short line: pyarrow's S3 errors, several clauses about
    the request, come down to the AWS error and its cause."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    aws = _AWS_ERROR.search(text)
    if aws:
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        text = f"{aws.group(1)}: {aws.group(2).strip()}" + (f", endpoint {endpoint}" if endpoint else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."
