"""raylane.loop.checkpoint's names: the package loads its torch-dependent modules only when one of
their names is first used (the driver's checks read manifests without torch), so each such name
is listed three times (the imports for type checkers, `__all__` and the table `_LAZY`); these
tests keep the three lists, and the modules they name, in agreement."""

from __future__ import annotations

import ast
import subprocess
import sys
from importlib import import_module
from pathlib import Path

from raylane.loop import checkpoint

PACKAGE = "raylane.loop.checkpoint"
INIT = Path(checkpoint.__file__)


def _type_checking_imports() -> tuple[dict[str, str], set[str]]:
    """(name -> module of the package it comes from, modules imported whole) under TYPE_CHECKING."""
    tree = ast.parse(INIT.read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"
    )
    names, modules = {}, set()
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module, ast.dump(node)
        if node.module == PACKAGE:
            modules |= {a.name for a in node.names}
        else:
            assert node.module.startswith(PACKAGE + "."), node.module
            names |= {a.name: node.module.removeprefix(PACKAGE + ".") for a in node.names}
    return names, modules


def _eager_names() -> set[str]:
    """The names the package imports at its top, from its torch-free modules."""
    tree = ast.parse(INIT.read_text())
    return {
        a.name
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith(PACKAGE + ".")
        for a in n.names
    }


def test_the_lazy_table_names_what_type_checkers_see():
    names, modules = _type_checking_imports()
    assert names == checkpoint._LAZY
    assert modules == checkpoint._LAZY_MODULES


def test_all_is_the_eager_and_the_lazy_names():
    assert set(checkpoint.__all__) == _eager_names() | set(checkpoint._LAZY) | checkpoint._LAZY_MODULES
    assert len(checkpoint.__all__) == len(set(checkpoint.__all__))


def test_every_lazy_name_resolves_to_its_module():
    for name, module in checkpoint._LAZY.items():
        assert getattr(checkpoint, name) is getattr(import_module(f"{PACKAGE}.{module}"), name), name
    for module in checkpoint._LAZY_MODULES:
        assert getattr(checkpoint, module) is import_module(f"{PACKAGE}.{module}")


def test_importing_the_package_imports_no_torch():
    code = f"import sys, {PACKAGE} as c; c.read_manifest; c.CHECKPOINT_PREFIX; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
