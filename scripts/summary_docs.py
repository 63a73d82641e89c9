"""Write docs/summary.md and docs/summary.schema.json from raylane.results (`make docs`), or with
`--check` exit 1 when the committed pages differ from what the code generates (tests/unit/test_results.py
runs the same comparison)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from pydantic import BaseModel

from raylane import results

DOCS = Path(__file__).resolve().parent.parent / "docs"
INTRO = f"""# Summaries: what each command returns and writes

<!-- Generated from app/raylane/results.py by `make docs` (scripts/summary_docs.py); do not edit. -->

Every command that runs something writes its summary with `--summary-json PATH`, and the Python
API returns the same thing as a typed object (`raylane.train()` a `TrainSummary`, and so on).
Each file carries `schema_version` ({results.SCHEMA_VERSION} today) and `command`; a field is never renamed, retyped
or dropped within a version. `raylane.read_summary(path)` reads any of them back as its type;
[summary.schema.json](summary.schema.json) is the JSON Schema of all five (a `oneOf` on
`command`), for tools in other languages.

`status` is one of FINISHED, FAILED or KILLED, and decides the exit code:

| status | exit code |
| --- | --- |
{chr(10).join(f"| {s.value} | {code} |" for s, code in results.EXIT_CODES.items())}

Bad input exits 2 before anything starts, and writes no summary. `raylane submit --follow` maps
the job's end (`job_status`) to a status: {", ".join(f"{k} is {v.value}" for k, v in results.JOB_STATUSES.items())}.
"""


def type_text(annotation: object) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = re.sub(r"\b(typing|raylane\.results|pydantic\.main)\.", "", text)
    text = text.replace("NoneType", "null").replace("<class '", "").replace("'>", "").replace("None", "null")
    text = re.sub(r"Literal\[([^\]]*)\]", lambda m: m.group(1).replace(", ", " | ").replace("'", '"'), text)
    return text.replace("|", "\\|")  # a bare | would split the table's cell


def table(model: type[BaseModel]) -> list[str]:
    lines = ["| field | type | description |", "| --- | --- | --- |"]
    for name, field in model.model_fields.items():
        shown = field.alias or name
        lines.append(f"| `{shown}` | `{type_text(field.annotation)}` | {field.description or ''} |")
    return lines


def markdown() -> str:
    parts, seen = [INTRO], set()
    for command, model in results.SUMMARIES.items():
        parts += [f"## `raylane {command}`: {model.__name__}", "", (model.__doc__ or "").strip(), "", *table(model), ""]
        queue = [m for f in model.model_fields.values() for m in results.models_in(f.annotation)]
        while queue:
            part = queue.pop(0)
            if part in seen:
                continue
            seen.add(part)
            parts += [f"### {part.__name__}", "", *table(part), ""]
            queue += [m for f in part.model_fields.values() for m in results.models_in(f.annotation)]
    return "\n".join(parts).rstrip() + "\n"


def pages() -> dict[Path, str]:
    return {
        DOCS / "summary.md": markdown(),
        DOCS / "summary.schema.json": json.dumps(results.json_schema(), indent=2, sort_keys=True) + "\n",
    }


def main(argv: list[str]) -> int:
    stale = [path for path, text in pages().items() if not path.exists() or path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path} differs from what app/raylane/results.py generates: run `make docs`", file=sys.stderr)
        return 1 if stale else 0
    for path, text in pages().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
