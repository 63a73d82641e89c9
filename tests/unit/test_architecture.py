"""The layout's rules, read from the source (nothing runs): no import cycle between raylane's
modules, the training loop and autotune's search free of Ray, and the Trainer's private methods
called by the Trainer alone. `python tests/unit/test_architecture.py` prints which package imports which."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "app" / "raylane"
# Modules that run on the ranks under torchrun or in one process too: Ray may not be imported.
RAY_FREE = (
    "raylane.loop",
    "raylane.autotuning.search",
    "raylane.autotuning.order",
    "raylane.autotuning.ranking",
    "raylane.autotuning.costs",
    "raylane.pipelines",
)


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):  # rglob does not enter the pipelines link: added below
        parts = ["raylane", *path.relative_to(SRC).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted((SRC / "pipelines").glob("*.py")):
        found["raylane.pipelines" + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function (a lazy import is still an edge)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for imported in imports(path):
            while imported and imported not in mods:
                imported = imported.rpartition(".")[0]
            # A package's __init__ runs before its submodules: `from raylane.x import y` is an edge
            # to raylane.x.y, and to raylane.x only when that package is not an ancestor of `name`.
            if imported and imported != name and imported != "raylane" and not name.startswith(imported + "."):
                targets.add(imported)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles between raylane's modules: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_loop_and_autotunes_search_never_import_ray():
    """Nor does anything they import, at any depth."""
    mods, edges = modules(), graph()
    reached, todo = set(), [m for m in mods if m.startswith(RAY_FREE)]
    while todo:
        m = todo.pop()
        if m not in reached:
            reached.add(m)
            todo += edges[m]
    offenders = sorted(
        f"{name} imports {imported}"
        for name in reached
        for imported in imports(mods[name])
        if imported.split(".")[0] == "ray" or imported.startswith("raylane.onray")
    )
    assert not offenders, offenders


def test_nothing_outside_the_trainer_calls_its_private_methods():
    trainer = SRC / "loop" / "trainer.py"
    tree = ast.parse(trainer.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    private = {
        f.name
        for f in cls.body
        if isinstance(f, ast.FunctionDef) and f.name.startswith("_") and not f.name.startswith("__")
    }
    assert {"_run_epoch", "_save_checkpoint"} <= private  # the tutorial Trainer's shape (its step: run_step)
    calls = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                owner = node.value
                if path != trainer and not (isinstance(owner, ast.Name) and owner.id == "self"):
                    calls.append(f"{name}:{node.lineno} .{node.attr}")
    assert not calls, calls


def layers(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which package imports which (a top-level module counts as its own package)."""

    def package(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:2])

    out: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if package(a) != package(b):
                out[package(a)].add(package(b))
    return out


if __name__ == "__main__":
    for pkg, targets in sorted(layers(graph()).items()):
        print(f"{pkg} -> {', '.join(sorted(targets))}")
