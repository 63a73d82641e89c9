"""The layout's rules, read from the source (nothing runs): no import cycle between raylane's
modules, the training loop and autotune's search free of Ray, the Trainer's private methods
called by the Trainer alone, no module importing from a floor above its own (LAYERS), and no
module or script taking another module's private name. `python tests/unit/test_architecture.py`
prints the floors, every import against them, every private name taken, and which package
imports which."""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "app" / "raylane"
# Modules that run on the ranks under torchrun or in one process too: Ray may not be imported.
RAY_FREE = (
    "raylane.loop",
    "raylane.config",
    "raylane.session",
    "raylane.clusters",
    "raylane.sweeps",
    "raylane.runrecord",
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


@functools.cache
def parse(path: Path) -> ast.Module:
    """Each file parsed once for all the tests (the parse is most of their time)."""
    return ast.parse(path.read_text(), str(path))


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function (a lazy import is still an edge)."""
    names = set()
    for node in ast.walk(parse(path)):
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
        for node in ast.walk(parse(path)):
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


# -- the floors ------------------------------------------------------------------------------------

# Bottom up: a module may import its own floor and those below, never one above (issue 48, item 5).
# A name maps every module under it (raylane.config: the config package and all its modules), so
# the table holds for modules that do not exist yet; the longest name that matches wins.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "ground",
        (
            "raylane.errors",
            "raylane.paths",
            "raylane.results",
            "raylane.version",
            "raylane.logs",
            "raylane.pipelines_ref",
        ),
    ),
    ("config", ("raylane.config", "raylane.lease")),
    # The loop by concept (issue 61), bottom up: where a run's state is kept (every other part
    # writes into the run's folder through its store); what the loop and its launcher or the
    # user's pipeline agree on; the layout over devices; the data; what is measured and watched;
    # the loop itself. The run record reads checkpoint manifests (torch-free).
    ("loop: checkpoints", ("raylane.loop.checkpoint",)),
    ("loop: protocols", ("raylane.loop.protocols",)),
    ("loop: distributed", ("raylane.loop.distributed",)),
    ("loop: data", ("raylane.loop.data",)),
    ("loop: observe", ("raylane.loop.observe",)),
    ("loop", ("raylane.loop", "raylane.prechecks", "raylane.layout_checks", "raylane.export", "raylane.runrecord")),
    ("tracking and hf", ("raylane.tracking", "raylane.hf")),
    # The Ray-free halves of every run kind: the lifecycle, where a cluster is (addresses, a local
    # head's record), a sweep's plan-free record and results (read from MLflow).
    ("session", ("raylane.session", "raylane.clusters", "raylane.sweeps")),
    ("onray", ("raylane.onray",)),
    ("drivers", ("raylane.driver", "raylane.autotuning")),
    # raylane.pipelines: the example pipelines, user code that the loop loads by its `module:name`
    # string and no library module imports; like a user's project, it may use anything.
    (
        "doors",
        (
            "raylane.api",
            "raylane.cli",
            "raylane.cli_tools",
            "raylane.config_keys",
            "raylane.__main__",
            "raylane.pipelines",
            # `raylane k8s check`: loads a RayJob's config as `raylane submit` does (raylane.api.prepare_submit).
            "raylane.k8s",
        ),
    ),
)
DOOR = "raylane"  # the package's __init__, matched by this exact name only: every module is under it
# "importer -> imported": a climb the design keeps, with the reason. Empty: the design needs none.
ALLOWED_CLIMBS: dict[str, str] = {}
# Climbs in the code today that issue 48's other changes remove; the integrator empties this list
# after merging them. A climb not listed here fails the test.
# Climbs the code still makes that a later change removes (empty: none).
KNOWN_CLIMBS: set[str] = set()


def layer_of(module: str) -> int | None:
    """The floor of `module` (an index into LAYERS), or None when no name of the table covers it."""
    if module == DOOR:
        return len(LAYERS) - 1
    best: tuple[int, int] | None = None  # (length of the matching name, floor)
    for floor, (_, names) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[0]):
                best = (len(name), floor)
    return None if best is None else best[1]


def door_names(path: Path, mods: dict[str, Path]) -> set[str]:
    """Names `path` takes from the package door itself (`from raylane import __version__`), which
    graph() leaves out: every module's import runs raylane/__init__, so only such a name is an
    edge to it."""
    return {
        a.name
        for node in ast.walk(parse(path))
        if isinstance(node, ast.ImportFrom) and node.module == DOOR and node.level == 0
        for a in node.names
        if f"{DOOR}.{a.name}" not in mods
    }


def layer_edges() -> dict[str, set[str]]:
    """graph()'s edges, lazy imports included, and those to the package door."""
    mods, edges = modules(), graph()
    for name, path in mods.items():
        if name != DOOR and door_names(path, mods):
            edges[name] = edges[name] | {DOOR}
    return edges


def climbs(edges: dict[str, set[str]] | None = None) -> list[str]:
    """Every "importer -> imported" where the imported module sits on a higher floor."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in (layer_edges() if edges is None else edges).items()
        for b in targets
        if (layer_of(a) or 0) < (layer_of(b) or 0)
    )


def test_every_module_has_a_floor():
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert not unplaced, f"modules no floor of LAYERS covers (add each where it belongs): {unplaced}"


def test_no_module_imports_from_a_floor_above_its_own():
    found = set(climbs()) - set(ALLOWED_CLIMBS)
    new = sorted(found - KNOWN_CLIMBS)
    assert not new, (
        "imports against the floors (LAYERS; `python tests/unit/test_architecture.py` lists them): " + "; ".join(new)
    )
    gone = sorted(KNOWN_CLIMBS - found)
    assert not gone, f"no longer imported: take these out of KNOWN_CLIMBS: {gone}"


def test_the_floor_checker_finds_a_climb():
    assert layer_of("raylane.config.autotune") == layer_of("raylane.config") == 1
    assert layer_of("raylane.config_keys") == layer_of(DOOR) == len(LAYERS) - 1
    assert layer_of("raylane.loop.checkpoint.saving") == 2 and layer_of("raylane.nowhere") is None
    floors = [layer_of(f"raylane.loop.{p}.x") for p in ("checkpoint", "protocols", "distributed", "data", "observe")]
    assert floors == sorted(floors) and len(set(floors)) == 5 and layer_of("raylane.loop.run") == floors[-1] + 1


def test_a_planted_upward_import_in_the_loop_fails():
    """The loop's floors hold in the source (test above) and catch a climb planted among its real
    edges: a checkpoint module taking the reporter, a layout module the health sampler."""
    planted = {
        "raylane.loop.checkpoint.saving": {"raylane.loop.reporting"},
        "raylane.loop.distributed.groups": {"raylane.loop.observe.health"},
        "raylane.loop.observe.health": {"raylane.loop.distributed.groups"},  # downward: fine
    }
    edges = layer_edges()
    for a, targets in planted.items():
        edges[a] = edges.get(a, set()) | targets
    assert set(climbs(edges)) - set(climbs()) == {
        "raylane.loop.checkpoint.saving -> raylane.loop.reporting",
        "raylane.loop.distributed.groups -> raylane.loop.observe.health",
    }


# -- private names -----------------------------------------------------------------------------

SCRIPTS = SRC.parents[1] / "scripts"
# "importer: module._name": a private name the design lets cross, with the reason. Should stay empty.
ALLOWED_PRIVATE: dict[str, str] = {}
# Private reaches in the code today that issue 48's other changes make public; the integrator
# empties this list after merging them.
KNOWN_PRIVATE: set[str] = set()


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def sources() -> dict[str, Path]:
    """raylane's modules, and the scripts (named scripts.x), which use raylane as a user would."""
    found = dict(modules())
    for path in sorted(SCRIPTS.rglob("*.py")):
        found[".".join(["scripts", *path.relative_to(SCRIPTS).with_suffix("").parts])] = path
    return found


def private_reaches(path: Path, mods: dict[str, Path]) -> set[str]:
    """`module._name` for every private name of another raylane module that `path` takes:
    `from module import _name`, or `module._name` on a module it imported (under any alias)."""

    def module_of(dotted: str) -> str | None:
        return dotted if dotted in mods else None

    tree = parse(path)
    found, bound = set(), {}  # bound: local name -> the raylane module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                if private(a.name) and module_of(node.module):
                    found.add(f"{node.module}.{a.name}")
                elif module_of(f"{node.module}.{a.name}"):
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and module_of(a.name):
                    bound[a.asname] = a.name
                elif a.name.split(".")[0] == DOOR:
                    bound[DOOR] = DOOR
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            parts, value = [], node.value
            while isinstance(value, ast.Attribute):
                parts.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in bound:
                owner = ".".join([bound[value.id], *parts])
                if module_of(owner):
                    found.add(f"{owner}.{node.attr}")
    return found


def private_imports() -> list[str]:
    mods = modules()
    return sorted(
        f"{name}: {reach}"
        for name, path in sources().items()
        for reach in private_reaches(path, mods)
        if not reach.startswith(name + "._")  # its own name, through its package
    )


def test_no_module_takes_another_modules_private_name():
    found = set(private_imports()) - set(ALLOWED_PRIVATE)
    new = sorted(found - KNOWN_PRIVATE)
    assert not new, "private names taken from another module (make them public where they are shared): " + "; ".join(
        new
    )
    gone = sorted(KNOWN_PRIVATE - found)
    assert not gone, f"no longer taken: take these out of KNOWN_PRIVATE: {gone}"


def test_the_private_finder_sees_imports_and_attributes(tmp_path):
    code = tmp_path / "x.py"
    code.write_text(
        "from raylane.errors import _missing, DataError\n"
        "import raylane.loop.checkpoint.state as st\n"
        "from raylane.loop.data import files\n"
        "import raylane.driver\n"
        "def f(self):\n"
        "    st._describe(files._open, self._x, raylane.driver._start_ray, files.__name__)\n"
    )
    mods = {
        m: Path()
        for m in (
            "raylane",
            "raylane.errors",
            "raylane.loop.checkpoint.state",
            "raylane.loop.data.files",
            "raylane.driver",
        )
    }
    assert private_reaches(code, mods) == {
        "raylane.errors._missing",
        "raylane.loop.checkpoint.state._describe",
        "raylane.loop.data.files._open",
        "raylane.driver._start_ray",
    }


def _report() -> None:
    """The floors, each import against them and each private name taken (KNOWN: today's, which
    the other changes of issue 48 remove), then which package imports which."""
    for floor, (title, names) in enumerate(LAYERS):
        print(f"{floor} {title}: {', '.join(names)}")
    for heading, found, known, allowed in (
        ("imports against the floors", climbs(), KNOWN_CLIMBS, ALLOWED_CLIMBS),
        ("private names taken from another module", private_imports(), KNOWN_PRIVATE, ALLOWED_PRIVATE),
    ):
        print(f"\n{heading}: {len(found) or 'none'}")
        for line in found:
            print(f"  {line}" + (" (allowed)" if line in allowed else " (KNOWN)" if line in known else " (NEW)"))
    print("\nwhich package imports which:")
    for pkg, targets in sorted(layers(graph()).items()):
        print(f"  {pkg} -> {', '.join(sorted(targets))}")


if __name__ == "__main__":
    _report()
