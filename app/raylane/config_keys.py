"""The config's keys as documentation: every dotted key of a config model (a pipeline's Config, a
sweep file's `sweep:` section, the `autotune:` section) with its type, default, allowed values
and description, all read from the fields where they are declared. docs/configuration.md
(scripts/config_docs.py) and `raylane check CONFIG --explain KEY` print them. Nothing here
imports torch or Ray."""

from __future__ import annotations

import builtins
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from raylane import pipelines_ref
from raylane.config import BaseConfig, ConfigError, did_you_mean
from raylane.paths import PathValue


class _Required:
    def __repr__(self) -> str:
        return "required"


REQUIRED: Any = _Required()  # the default of a key that has none


@dataclass(frozen=True)
class Key:
    """One dotted key. `section`: the key holds a section of keys of its own (they follow it, as
    `train.early_stopping.metric` follows `train.early_stopping`); `model` is that section's."""

    key: str
    type: str
    default: Any
    allowed: str
    description: str
    section: bool = False
    model: builtins.type[BaseModel] | None = None  # `type` above is the key's type, as text


def keys(model: type[BaseModel], prefix: str = "", *, sections: bool = False) -> list[Key]:
    """Every key of `model` and of its sections, in declaration order. A section that may be null
    (`early_stopping: EarlyStoppingSection | None`) is a key itself; one that is always there
    (`train`) is only a prefix, unless `sections`."""
    found = []
    for name, field in model.model_fields.items():
        dotted, sub = prefix + name, _section(field.annotation)
        if sub is None:
            found.append(Key(dotted, type_text(field), _default(field), allowed_text(field), description(model, name)))
            continue
        nullable = _nullable(field.annotation)
        if nullable or sections:
            default = _default(field) if nullable else REQUIRED if field.is_required() else "{...}"
            found.append(
                Key(
                    dotted,
                    "section | null" if nullable else "section",
                    default,
                    "",
                    description(model, name) or _doc(sub),
                    section=True,
                    model=sub,
                )
            )
        found.extend(keys(sub, dotted + ".", sections=sections))
    return found


def description(model: type[BaseModel], name: str) -> str:
    """The field's description, or that of the nearest base class declaring it: a pipeline that
    narrows a field (`pipeline: Literal["digits"]`) keeps its meaning."""
    for cls in model.__mro__:
        field = getattr(cls, "__pydantic_fields__", {}).get(name)
        if field is not None and field.description:
            return field.description
    return ""


def type_text(field: FieldInfo) -> str:
    if any(isinstance(m, PathValue) for m in field.metadata) or _holds_path(field.annotation):
        text = "path | list[path]" if list in _flat_args(field.annotation) else "path"
        return text + (" | null" if _nullable(field.annotation) else "")
    return _type_name(field.annotation)


def _type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return "str" if all(isinstance(a, str) for a in args) else " | ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        parts = [_literal_or_type(a) for a in args if a is not type(None)]
        return " | ".join(parts + (["null"] if type(None) in args else []))
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if origin is dict:
        return "mapping"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _holds_path(annotation: Any) -> bool:
    """An `InputPath | None`: the path marker inside the union."""
    if typing.get_origin(annotation) is Annotated:
        return any(isinstance(m, PathValue) for m in annotation.__metadata__)
    return any(_holds_path(a) for a in typing.get_args(annotation))


def _literal_or_type(annotation: Any) -> str:
    """In a union, a Literal shows its values: `int | "auto"`."""
    if typing.get_origin(annotation) is Literal:
        return " | ".join(f'"{a}"' for a in typing.get_args(annotation))
    return _type_name(annotation)


def allowed_text(field: FieldInfo) -> str:
    """The values a key accepts beyond its type: a Literal's values, a number's range, a length,
    a pattern ("" when any value of the type is)."""
    parts = []
    literal = _literal_values(field.annotation)
    if literal:
        parts.append(", ".join(map(str, literal)))
    low = next(
        (
            f"{_number(m.ge)} <=" if isinstance(m, at.Ge) else f"{_number(m.gt)} <"
            for m in field.metadata
            if isinstance(m, (at.Ge, at.Gt))
        ),
        "",
    )
    high = next(
        (
            f"<= {_number(m.le)}" if isinstance(m, at.Le) else f"< {_number(m.lt)}"
            for m in field.metadata
            if isinstance(m, (at.Le, at.Lt))
        ),
        "",
    )
    if low or high:
        parts.append(" ".join(p for p in (low, "x", high) if p))
    lengths = [m for m in field.metadata if isinstance(m, (at.MinLen, at.MaxLen))]
    if lengths:
        parts.append(_length(field.annotation, lengths))
    pattern = next((m.pattern for m in field.metadata if getattr(m, "pattern", None)), None)
    if pattern:
        parts.append(f"matches {pattern}")
    return "; ".join(parts)


def _literal_values(annotation: Any) -> list[Any]:
    """The values of a Literal field (or of a list of them, or one that may be null)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return list(args)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _literal_values(inner[0]) if len(inner) == 1 else []
    if origin is list:
        return _literal_values(args[0])
    return []


def _length(annotation: Any, lengths: list[Any]) -> str:
    low = next((m.min_length for m in lengths if isinstance(m, at.MinLen)), 0)
    high = next((m.max_length for m in lengths if isinstance(m, at.MaxLen)), None)
    what = "characters" if str in _flat_args(annotation) and list not in _flat_args(annotation) else "items"
    if high is not None:
        return f"{low} to {high} {what}"
    return "not empty" if low == 1 else f"at least {low} {what}"


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _flat_args(annotation: Any) -> set[Any]:
    """The types a field's annotation is made of (`str | list[str] | None` -> {str, list, NoneType})."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _flat_args(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_flat_args(a) for a in typing.get_args(annotation)))
    return {origin or annotation}


def _nullable(annotation: Any) -> bool:
    return type(None) in typing.get_args(annotation)


def _section(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (itself, or inside `X | None`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    inner = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(inner) == 1:
        return _section(inner[0])
    return None


def _default(field: FieldInfo) -> Any:
    return REQUIRED if field.is_required() else field.get_default(call_default_factory=True)


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def value_text(value: Any) -> str:
    """A value as YAML writes it in a config: null, true, 0.001, [1, 2], {a: 1}."""
    if value is REQUIRED:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, BaseModel):
        return value_text(value.model_dump(mode="json"))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(value_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {value_text(v)}" for k, v in value.items()) + "}"
    if value == "":
        return '""'
    return str(value)


# ---- raylane check --explain KEY


def other_sections() -> dict[str, type[BaseModel]]:
    """The sections a pipeline config does not hold: a sweep file's and autotune's."""
    from raylane.config.autotune import AutotuneSection
    from raylane.config.sweep import SweepSection

    return {"sweep": SweepSection, "autotune": AutotuneSection}


def explain(cfg: BaseConfig, key: str) -> str:
    """What `raylane check --explain KEY` prints: the key's description, type, default, allowed
    values, and the value `cfg` resolves it to. ConfigError for a key of no section."""
    found = {k.key: k for k in keys(type(cfg), sections=True)}
    others = {
        k.key: k
        for name, model in other_sections().items()
        for k in [Key(name, "section", "{...}", "", _doc(model), True, model), *keys(model, name + ".")]
    }
    entry = found.get(key) or others.get(key)
    if entry is None:
        where = f"the {pipelines_ref.label(cfg.pipeline)} config"
        raise ConfigError(
            f"--explain {key}: not a key of {where}, a sweep file or autotune{did_you_mean(key, [*found, *others])}"
        )
    lines = [key, *textwrap.wrap(entry.description, 96, initial_indent="  ", subsequent_indent="  ")]
    rows = [("type", entry.type), ("allowed", entry.allowed), ("default", value_text(entry.default))]
    if entry.section and entry.model is not None:
        rows.append(("keys", ", ".join(k.key.removeprefix(key + ".") for k in keys(entry.model))))
    rows.append(_resolved(cfg, key, key in found))
    lines += [f"  {name + ':':10}{text}" for name, text in rows if text]
    return "\n".join(lines)


def _resolved(cfg: BaseConfig, key: str, ours: bool) -> tuple[str, str]:
    if not ours:
        what = "a sweep file's" if key.startswith("sweep") else "`raylane autotune`'s"
        return "resolved", f"not here: {what} key, not this config's"
    node: Any = cfg.model_dump(mode="json")
    parts = key.split(".")
    for i, part in enumerate(parts):
        if node is None:  # a key of an optional section that is off
            return "resolved", f"- ({'.'.join(parts[:i])} is null)"
        node = node[part]
    return "resolved", value_text(node)


def all_models() -> Iterator[tuple[str, type[BaseModel]]]:
    """(name, model) of everything docs/configuration.md documents."""
    yield "base", BaseConfig
    yield from other_sections().items()
    for name in pipelines_ref.SHIPPED:
        yield name, pipelines_ref.load(name).Config
