"""Write docs/configuration.md from the config models (`make docs`), or with `--check` exit 1 when
the committed page differs from what the code generates (tests/unit/test_config_docs.py runs the same
comparison). Every key, its type, default, allowed values and description come from the fields
where they are declared (raylane.config_keys)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from raylane import config_keys, pipelines_ref
from raylane.config import BaseConfig, load_config
from raylane.config_keys import REQUIRED, Key, value_text

DOCS = Path(__file__).resolve().parent.parent / "docs"
SHIPPED_DIR = Path(importlib.import_module("raylane.pipelines").__file__).parent
EXAMPLE = ["check", "digits", "--set", "train.batch_size=64", "--explain", "train.batch_size"]

INTRO = """# Configuration reference

<!-- Generated from the config models by `make docs` (scripts/config_docs.py); do not edit. -->

A pipeline config is one YAML file (read as `yaml.safe_load` reads it, except that a key given
twice in one mapping exits 2 naming the key and both lines), validated once, before anything
starts. `--set dotted.key=value` overrides any key (the value is read as YAML: `true`, `null`,
`1e-3`, `[1, 2]`); the same dotted keys are a sweep's `space` and the run's MLflow params. An
unknown key, a wrong type or a value out of range exits 2 with one line naming the key and the
value (with a "did you mean" for a misspelt key).

`raylane check CONFIG` prints the whole config as it resolves; `raylane check CONFIG --explain
KEY` prints one key: its description, type, default, allowed values, and the value this config
resolves it to (a section's key lists its keys; an unknown key exits 2 with a "did you mean"):

```text
$ raylane {example}
{explained}
```

In the tables: `path` is a file, a folder or a glob (an input must exist; `s3://` URIs too); an
input path written in a config file is relative to that file's folder, and a `--set` value, an
output (`run.storage_path`) or a default to the working directory. `| null` marks a key that may
be null; `required` a key without a default. A key whose type is `section | null` is a section
that is off (null) by default; its own keys follow it. `x` in a range is the key's value.

Sections: {sections}; the shipped [pipelines](#pipelines)' own keys and configs.
"""


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    return f"`{cell(text)}`" if text else ""


def table(entries: list[Key]) -> list[str]:
    lines = ["| key | type | default | allowed | description |", "| --- | --- | --- | --- | --- |"]
    for k in entries:
        default = "required" if k.default is REQUIRED else code(value_text(k.default))
        lines.append(f"| `{k.key}` | {code(k.type)} | {default} | {cell(k.allowed)} | {cell(k.description)} |")
    return lines


def doc(obj: Any) -> str:
    """The first paragraph of a docstring, on one line."""
    return " ".join((obj.__doc__ or "").strip().split("\n\n")[0].split())


def base_sections() -> list[str]:
    parts = ["## `pipeline`", "", *table(config_keys.keys(BaseConfig)[:1]), ""]
    for name, field in BaseConfig.model_fields.items():
        if name == "pipeline":
            continue
        model = field.annotation
        if not hasattr(model, "model_fields"):  # a top-level key, not a section (`env`)
            parts += [f"## `{name}`", "", *table([k for k in config_keys.keys(BaseConfig) if k.key == name]), ""]
            continue
        parts += [f"## `{name}`", "", doc(model), "", *table(config_keys.keys(model, f"{name}.")), ""]
    intros = {
        "sweep": "",
        "autotune": "A pipeline config's optional `autotune:` section, read by `raylane autotune` "
        "(`--set autotune.KEY=VALUE` there sets it too; the other commands ignore it). ",
    }
    for name, model in config_keys.other_sections().items():
        parts += [f"## `{name}`", "", intros[name] + doc(model), "", *table(config_keys.keys(model, f"{name}.")), ""]
    return parts


def lookup(raw: Any, key: str) -> tuple[bool, Any]:
    for part in key.split("."):
        if not isinstance(raw, dict) or part not in raw:
            return False, None
        raw = raw[part]
    return True, raw


def shipped_configs() -> dict[str, list[tuple[str, dict]]]:
    """Pipeline name -> [(file name, its YAML)], a sweep file under its base config's pipeline."""
    raws = {p.name: yaml.safe_load(p.read_text()) for p in sorted(SHIPPED_DIR.glob("*.yaml"))}
    found: dict[str, list[tuple[str, dict]]] = {}
    for name, raw in raws.items():
        pipeline = raw.get("pipeline") or raws[f"{raw['sweep']['base']}.yaml"]["pipeline"]
        found.setdefault(pipeline, []).append((name, raw))
    return found


def config_values(name: str, raw: dict, model: type[BaseModel]) -> list[str]:
    """The keys a shipped config sets to other than their default."""
    entries = config_keys.keys(model)
    command = "train"
    if "sweep" in raw:
        entries = config_keys.keys(config_keys.other_sections()["sweep"], "sweep.") + entries
        command = "tune"
    lines = [
        f"`{name}` (`raylane {command} {Path(name).stem}`) sets:",
        "",
        "| key | value | default |",
        "| --- | --- | --- |",
    ]
    for k in entries:
        present, value = lookup(raw, k.key)
        if present and not (k.section and isinstance(value, dict)) and value != k.default:
            default = "required" if k.default is REQUIRED else code(value_text(k.default))
            lines.append(f"| `{k.key}` | {code(value_text(value))} | {default} |")
    return lines


def pipeline_sections() -> list[str]:
    intro = (
        "Each shipped pipeline's own keys (those it adds to the sections above, or narrows), then its shipped "
        "configs: the values each sets other than the defaults. A pipeline of your own declares its keys the "
        "same way (docs/pipelines.md); `raylane.hf.Config` gives one built on `raylane.hf.pipeline` the keys of "
        "`hf`."
    )
    parts = ["## Pipelines", "", intro, ""]
    base = {k.key: k for k in config_keys.keys(BaseConfig)}
    configs = shipped_configs()
    for name, module in pipelines_ref.SHIPPED.items():
        cls = pipelines_ref.load(name).Config
        own = [k for k in config_keys.keys(cls) if base.get(k.key) != k]
        parts += [f"### `{name}`", "", f"{doc(importlib.import_module(module))} (`{module}`)", "", *table(own), ""]
        for file, raw in configs.get(name, []):
            parts += [*config_values(file, raw, cls), ""]
    return parts


def explained() -> str:
    from raylane.cli import parser

    args = parser().parse_args(EXAMPLE)
    return config_keys.explain(load_config(args.config, args.overrides), args.explain)


def markdown() -> str:
    names = [name for name in BaseConfig.model_fields] + list(config_keys.other_sections())
    intro = INTRO.format(
        example=" ".join(EXAMPLE), explained=explained(), sections=", ".join(f"[{n}](#{n})" for n in names)
    )
    return "\n".join([intro, *base_sections(), *pipeline_sections()]).rstrip() + "\n"


def pages() -> dict[Path, str]:
    return {DOCS / "configuration.md": markdown()}


def main(argv: list[str]) -> int:
    stale = [path for path, text in pages().items() if not path.exists() or path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path} differs from what the config models generate: run `make docs`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in pages().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
