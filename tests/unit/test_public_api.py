"""raylane's public API: the names users build on stay, and the shipped pipelines use only them,
as a user's pipeline would (everything else, raylane.loop and the rest, may change)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import raylane
import raylane.hf
from tests.conftest import REPO

# The promise, written out: removing or renaming one of these breaks users' code.
PUBLIC = {
    "BaseConfig",
    "ConfigError",
    "DataError",
    "FileSource",
    "Hook",
    "HookContext",
    "InputPath",
    "InputPaths",
    "OutputPath",
    "Pipeline",
    "Section",
    "StepFn",
    "__version__",
    "autotune",
    "check",
    "down",
    "frozen_base",
    "submit",
    "train",
    "tune",
    "up",
    "AutotuneSummary",
    "ExportSummary",
    "Status",
    "SubmitSummary",
    "SweepSummary",
    "TrainSummary",
    "read_summary",
}
PUBLIC_HF = {
    "Config",
    "DataSection",
    "ModelSection",
    "empty_model",
    "file_source",
    "load_pretrained",
    "pipeline",
    "tp_plan",
}
PIPELINES = sorted((REPO / "pipelines").glob("*.py"))
# A shipped pipeline's module is public too: one may build on another (text on gpt's model).
SHIPPED = {f"raylane.pipelines.{p.stem}" for p in PIPELINES if p.stem != "__init__"}


@pytest.mark.parametrize(
    ("module", "promised"), [(raylane, PUBLIC), (raylane.hf, PUBLIC_HF)], ids=["raylane", "raylane.hf"]
)
def test_every_public_name_is_exported_and_resolves(module, promised):
    missing = sorted(promised - set(module.__all__))
    assert not missing, f"{module.__name__}.__all__ lost public names: {missing}"
    unlisted = sorted(set(module.__all__) - promised)
    assert not unlisted, f"{module.__name__}.__all__ has {unlisted}: add them to this test's list (and the docs)"
    unresolved = [name for name in sorted(promised) if not hasattr(module, name)]
    assert not unresolved, f"{module.__name__} does not resolve {unresolved}"


def test_no_submodule_shadows_a_public_name():
    # Importing raylane.X sets the package's attribute X to the module: a function of that name
    # (raylane.autotune) would become the module once anything imported it.
    folder = Path(raylane.__file__).parent
    shadowed = [n for n in sorted(PUBLIC) if (folder / f"{n}.py").exists() or (folder / n / "__init__.py").exists()]
    assert not shadowed, f"modules of raylane named like public names: {shadowed}"


def non_public_imports(path: Path) -> list[str]:
    """`line: import` for each use of a raylane module or name outside the public set."""
    exported = {"raylane": set(raylane.__all__), "raylane.hf": set(raylane.hf.__all__)}
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            uses = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            uses = [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "raylane":
            uses = [("raylane", node.attr)] if node.attr != "hf" else []
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "hf"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "raylane"
        ):
            uses = [("raylane.hf", node.attr)]
        else:
            continue
        for module, name in uses:
            if module != "raylane" and not module.startswith("raylane."):
                continue
            if module in exported and (name is None or name in exported[module]):
                continue
            if module in SHIPPED and (name is None or not name.startswith("_")):
                continue
            what = (
                f"from {module} import {name}"
                if isinstance(node, ast.ImportFrom)
                else (f"import {module}" if name is None else f"{module}.{name}")
            )
            bad.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{node.lineno}: {what}")
    return bad


def test_shipped_pipelines_import_only_public_names():
    assert {p.stem for p in PIPELINES} >= {"digits", "gpt", "regression", "tabular", "text", "hf"}
    bad = [line for path in PIPELINES for line in sorted(non_public_imports(path), key=lambda s: int(s.split(":")[1]))]
    assert not bad, "shipped pipelines use raylane's internals:\n" + "\n".join(bad)


def test_the_check_names_an_internal_import(tmp_path):
    pipeline = tmp_path / "mine.py"
    pipeline.write_text("import raylane\nfrom raylane.loop.protocols.pipeline import Pipeline\nx = raylane.driver\n")
    lines = [line.split(": ", 1)[1] for line in non_public_imports(pipeline)]
    assert lines == ["from raylane.loop.protocols.pipeline import Pipeline", "raylane.driver"]


# Modules a user is told to import or call beside raylane and raylane.hf: their public names are
# public (docs/training.md, Public API).
PUBLIC_MODULES = {"raylane.hf.lora", "raylane.hf.export", "raylane.api"}
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# A call written in prose: `raylane.hf.lora.check_lora(path, cfg.lora)`.
PROSE_CALL = re.compile(r"`(raylane(?:\.\w+)+)\(")


def doc_internals(page: Path) -> list[str]:
    """`page:line: what` for each internal module or name a page tells users to import or call:
    in its Python blocks (as a pipeline's imports are checked) and in calls written in prose."""
    text, bad = page.read_text(), []
    for block in PYTHON_BLOCK.finditer(text):
        line = text[: block.start()].count("\n") + 1
        scratch = page.parent / f".{page.stem}-block.py"
        try:
            scratch.write_text(block.group(1))
            found = non_public_imports(scratch)
        except SyntaxError:  # a fragment (a function's body): its imports are checked line by line
            lines = [s for s in block.group(1).splitlines() if s.strip().startswith(("import ", "from "))]
            scratch.write_text("\n".join(s.strip() for s in lines))
            found = non_public_imports(scratch)
        finally:
            scratch.unlink(missing_ok=True)
        for f in found:
            what = f.split(": ", 1)[1]
            module = what.split()[1] if what.startswith(("from ", "import ")) else what.rpartition(".")[0]
            if module not in PUBLIC_MODULES:
                bad.append(f"{page.name}:{line + int(f.split(':')[1])}: {what}")
    for call in PROSE_CALL.finditer(text):
        module, _, name = call.group(1).rpartition(".")
        if module in PUBLIC_MODULES and not name.startswith("_"):
            continue
        if module in {"raylane", "raylane.hf"} and name in (raylane if module == "raylane" else raylane.hf).__all__:
            continue
        bad.append(f"{page.name}:{text[: call.start()].count(chr(10)) + 1}: {call.group(1)}()")
    return bad


def test_no_page_tells_users_to_use_an_internal_module():
    """The docs hold users to the public API: a page that says `raylane.loop.checkpoint.frozen.set_base(...)`
    (docs/pipelines.md did, while docs/training.md calls raylane.loop internal) fails here."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    bad = [line for page in pages for line in doc_internals(page)]
    assert not bad, "docs tell users to use raylane's internals:\n" + "\n".join(bad)


def test_the_doc_check_names_an_internal_call_and_import(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Call `raylane.loop.checkpoint.frozen.set_base(model, base)` or `raylane.frozen_base(model, path)`.\n\n"
        "```python\nimport raylane\nfrom raylane.onray.tune import run_sweep\n```\n"
    )
    assert doc_internals(page) == [
        "page.md:5: from raylane.onray.tune import run_sweep",
        "page.md:1: raylane.loop.checkpoint.frozen.set_base()",
    ]
