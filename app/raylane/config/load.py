"""Reading a config: a YAML file (or a mapping) plus `--set dotted.key=value`, validated once at
the edge into the pipeline's `Config` (raylane.config.sections).

Every user-facing mistake becomes a `ConfigError` whose message names the dotted field and the
bad value (with a "did you mean" for a misspelt key); the CLI turns it into exit code 2. Nothing
here imports torch or Ray, so a bad config is rejected before either starts."""

from __future__ import annotations

import copy
import difflib
import importlib
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from raylane import paths, pipelines_ref
from raylane.config.base import BaseConfig
from raylane.config.sections import short
from raylane.errors import ConfigError, DataError

# Shipped pipeline name -> module. A config may also name a dotted module or a .py file of the
# user's own (raylane.pipelines_ref).
PIPELINES: dict[str, str] = pipelines_ref.SHIPPED

M = TypeVar("M", bound=BaseModel)
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean X?)` for the closest of `choices`, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def check_metric(field: str, metric: str, cfg: BaseConfig) -> None:
    """`metric` is one the pipeline declares (BaseConfig.eval_metrics); anything goes when it
    declares none."""
    declared = cfg.eval_metrics()
    if declared is None or metric in declared:
        return
    hint = did_you_mean(metric, declared)
    raise ConfigError(
        f"{field} = {metric!r}: not a metric the {pipelines_ref.label(cfg.pipeline)} pipeline "
        f"reports{hint}; it reports: {', '.join(declared)}"
    )


def apply_values(cfg: BaseConfig, values: Mapping[str, Any]) -> BaseConfig:
    """`cfg` with `values` at their dotted keys, validated (a sweep's trial, an autotune candidate)."""
    known = cfg.flat()
    for key in values:
        if key not in known:
            raise ConfigError(f"{key}: not a key of the {cfg.pipeline} config{did_you_mean(key, known)}")
    raw = cfg.model_dump(mode="json")
    for key, value in values.items():
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return validate(raw)


def config_class(pipeline: Any) -> type[BaseConfig]:
    """The `Config` of a pipeline reference (see raylane.pipelines_ref); relative references are
    looked up from the working directory."""
    return pipeline_config(pipelines_ref.normalize(pipeline, [Path.cwd()]))


def pipeline_config(ref: str) -> type[BaseConfig]:
    """The `Config` class of a normalized pipeline reference, checked to be a BaseConfig."""
    config = pipelines_ref.load(ref).Config
    if not (isinstance(config, type) and issubclass(config, BaseConfig)):
        raise ConfigError(
            f"pipeline = {ref!r}: Config is {config!r}, not a subclass of raylane.BaseConfig ({pipelines_ref.CONTRACT})"
        )
    return config


def config_path(path: str | Path) -> Path:
    """The file a config argument names: the path itself, or for a bare name (`digits`,
    `gpt-tiny`) that is not a file here, the YAML shipped in `pipelines/`."""
    p = Path(path)
    shipped = _shipped_folder() / f"{path}.yaml"
    if not p.exists() and re.fullmatch(r"[A-Za-z0-9_-]+", str(path)) and shipped.exists():
        return shipped
    return p


def normalize_pipeline(raw: dict[str, Any], config_dir: Path) -> dict[str, Any]:
    """`raw` with its `pipeline:` resolved from the config file's directory, then the working
    directory (a relative file becomes an absolute path)."""
    if "pipeline" in raw:
        raw["pipeline"] = pipelines_ref.normalize(raw["pipeline"], [config_dir, Path.cwd()])
    return raw


class DuplicateKey(Exception):
    """A key given twice in one YAML mapping: `key` (dotted, from the document's top) at `lines`."""

    def __init__(self, key: str, lines: tuple[int, int]) -> None:
        super().__init__(
            f"key {key!r} is given twice in one mapping (lines {lines[0]} and {lines[1]}): YAML keeps only the last"
        )


class StrictLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader (the same safe construction), except that a key given twice in
    one mapping raises DuplicateKey: YAML would keep the second silently, and the author meant
    one of them. A merge (`<<: *base`) may still give a key the mapping sets itself."""

    def construct_document(self, node: yaml.Node) -> Any:
        self._where: dict[int, str] = {}
        self._name_mappings(node, "", set())
        return super().construct_document(node)

    def _name_mappings(self, node: yaml.Node, prefix: str, seen: set[int]) -> None:
        """Each mapping's dotted place in the document (`optim.`), to name a key in full."""
        if id(node) in seen:  # an alias of a node already named
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            self._where[id(node)] = prefix
            for key, value in node.value:
                self._name_mappings(
                    value, f"{prefix}{key.value}." if isinstance(key, yaml.ScalarNode) else prefix, seen
                )
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                self._name_mappings(item, prefix, seen)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in first:
                raise DuplicateKey(f"{self._where.get(id(node), '')}{key}", (first[key], line))
            first[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config file as `yaml.safe_load` does, but refusing a key given twice in one mapping
    (StrictLoader); see `config_path` for bare names."""
    p = config_path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(_not_found(str(path))) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r}: cannot read it ({exc.__class__.__name__})") from None
    try:
        data = yaml.load(text, Loader=StrictLoader)  # a SafeLoader: only safe construction
    except DuplicateKey as exc:
        raise ConfigError(f"config file {str(path)!r}: {exc}") from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"config file {str(path)!r}: invalid YAML{at}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: top level must be a mapping, got {short(data)}")
    return data


def shipped_configs() -> list[str]:
    """The names `raylane train NAME` finds in `pipelines/` (digits, digits-sweep, gpt-tiny, ...)."""
    return sorted(p.stem for p in _shipped_folder().glob("*.yaml"))


def _shipped_folder() -> Path:
    """The folder of the shipped pipelines and their configs (raylane.pipelines)."""
    return Path(str(importlib.import_module("raylane.pipelines").__file__)).parent


def _not_found(path: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", path):
        return f"config file {path!r}: no such file"
    shipped = shipped_configs()
    hint = did_you_mean(path, shipped)
    return f"config = {path!r}: no such file, and no shipped config of that name{hint}; shipped: {', '.join(shipped)}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); the value is read as YAML (numbers, bools, null, lists)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY_RE.match(key):
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw  # not YAML: keep it as the string the user typed
    # YAML 1.1 reads 1e-3 as a string; users mean a number.
    if isinstance(value, str):
        value = _maybe_float(value)
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(path[: i + 1])
                raise ConfigError(f"--set {text!r}: {where} is {short(child)}, not a section")
            node = child
        node[path[-1]] = value
    return raw


def validate(raw: Mapping[str, Any], *, outputs: bool = True) -> BaseConfig:
    """A config as read (a mapping) -> the validated config, its relative paths (those still
    relative: `--set` values, a mapping's, defaults) made absolute from the working directory.
    `outputs=False`: outputs (run.storage_path) are left as written, for a job that resolves them
    where it runs (raylane.onray.jobs)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: top level must be a mapping, got {short(raw)}")
    raw = dict(raw)
    raw["pipeline"] = pipelines_ref.normalize(raw.get("pipeline"), [Path.cwd()])
    cls = pipeline_config(raw["pipeline"])
    raw = paths.resolve(raw, cls, Path.cwd(), inputs_only=not outputs, defaults=outputs)
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, cls)) from None


def read_config_file(
    source: str | Path, raw: dict[str, Any] | None = None, pipeline: str | None = None
) -> dict[str, Any]:
    """A config file as read (`raw`, when it was read already): its `pipeline:` and its input
    paths (those of `pipeline`'s Config when the file names none: a sweep file's overrides)
    resolved from the file's folder, or from the working directory for a shipped config, which
    is a template however it is named; not validated."""
    raw = read_yaml(source) if raw is None else raw
    folder = config_path(source).resolve().parent
    raw = normalize_pipeline(raw, folder)
    ref = raw.get("pipeline") or pipeline
    try:
        cls = pipeline_config(ref) if isinstance(ref, str) else None
    except ConfigError:
        cls = None
    if cls is None:
        return raw  # validation names what is wrong
    shipped = folder == _shipped_folder().resolve()
    return paths.resolve(raw, cls, Path.cwd() if shipped else folder, inputs_only=True)


def load_config(
    source: str | Path | Mapping[str, Any], overrides: Iterable[str] = (), *, outputs: bool = True
) -> BaseConfig:
    """The edge: file (or mapping) + overrides -> a validated config, or ConfigError.
    `outputs`: see validate."""
    if not isinstance(source, (str, Path)):
        return validate(apply_overrides(copy.deepcopy(dict(source)), overrides), outputs=outputs)
    raw = read_yaml(source)
    if "sweep" in raw:  # the file's own, not a `--set sweep.x`, which is an unknown key
        raise ConfigError(
            f"config file {str(source)!r}: is a sweep file (it has a `sweep:` section): "
            f"run it with `raylane tune {source}`"
        )
    raw.pop("autotune", None)  # `raylane autotune`'s search space: the rest trains as it is
    raw = apply_overrides(read_config_file(source, raw), overrides)
    return validate(normalize_pipeline(raw, config_path(source).resolve().parent), outputs=outputs)


def format_validation_error(exc: ValidationError, model: type[BaseModel] | None = None, prefix: str = "") -> str:
    """One line for every error; an unknown key of `model` gets the closest known key as a hint
    (`prefix` is how the user writes the model's keys, e.g. `sweep.`)."""
    lines = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            parent = [str(p) for p in err["loc"][:-1]]
            known = [".".join([*parent, k]) for k in _fields_at(model, parent)]
            hint = did_you_mean(field, known).replace("mean ", f"mean {prefix}")
            lines.append(f"{field} = {short(err['input'])}: unknown key{hint}")
        elif err["type"] == "missing":
            lines.append(f"{field}: required")
        elif err["type"] == "value_error" and _own_message(err.get("ctx", {}).get("error")):
            lines.append(str(err["ctx"]["error"]))  # our own checks name their field and value
        else:
            lines.append(f"{field} = {short(err['input'])}: {err['msg']}")
    return "invalid config: " + "; ".join(lines)


def validate_section(model: type[M], raw: Any, key: str, what: str) -> M:
    """`raw` as the top-level `key:` section of a file (a sweep file's `sweep:`, a config's
    `autotune:`), or one ConfigError, `invalid <what>: ...`, each field named from the file's top
    (`sweep.metric = ...`)."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        text = format_validation_error(exc, model, f"{key}.").removeprefix("invalid config: ")
        parts = (p if p.startswith(f"{key}.") else f"{key}.{p}" for p in text.split("; "))
        raise ConfigError(f"invalid {what}: " + "; ".join(parts)) from None


def _own_message(error: Any) -> bool:
    """A check's error that is complete as it is: one naming its field and value, or a bad value
    in the data (raylane.DataError: the key, the file, the row)."""
    return isinstance(error, DataError) or " = " in str(error or "")


def _fields_at(model: Any, path: list[str]) -> list[str]:
    """The keys of the section at `path` below `model` ([] when it is not a section)."""
    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def _maybe_float(text: str) -> Any:
    try:
        value = float(text)
    except ValueError:
        return text
    return value if math.isfinite(value) and re.fullmatch(r"[+-]?\d*\.?\d+[eE][+-]?\d+", text) else text
