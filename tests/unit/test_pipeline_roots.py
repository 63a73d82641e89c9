"""What Ray ships of a user's code (`py_modules`): each top-level module or package loaded from a
pipeline root, and each pipeline file under the root's first directory, nothing else."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from raylane import pipelines_ref


@pytest.fixture
def fresh_roots(monkeypatch):
    monkeypatch.setattr(pipelines_ref, "_roots", [])
    monkeypatch.delenv(pipelines_ref.ROOTS_ENV, raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_a_roots_packages_modules_and_pipeline_files_are_shipped_and_nothing_else(tmp_path, fresh_roots):
    root, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    (root / "rlr_pkg" / "sub").mkdir(parents=True)
    (root / "rlr_pkg" / "__init__.py").write_text("")
    (root / "rlr_pkg" / "sub" / "__init__.py").write_text("")
    (root / "rlr_helper.py").write_text("X = 1\n")
    (root / "configs").mkdir()
    (root / "configs" / "pipe.py").write_text("Y = 2\n")
    (root / "rlr_pkg_extra.py").write_text("")  # a name that starts like the package's
    elsewhere.mkdir()
    (elsewhere / "rlr_outside.py").write_text("")
    pipelines_ref.add_root(root)
    sys.path.append(str(elsewhere))
    for name in ("rlr_pkg.sub", "rlr_helper", "rlr_outside", "rlr_pkg_extra"):
        __import__(name)
    spec_name = f"{pipelines_ref.FILE_MODULE_PREFIX}pipe_{tmp_path.name}"
    spec = importlib.util.spec_from_file_location(spec_name, root / "configs" / "pipe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec_name] = module
    spec.loader.exec_module(module)

    # Earlier tests of this process have loaded pipelines of their own: only this test's count.
    mine = str(tmp_path.resolve())
    found = {k: v for k, v in pipelines_ref.user_modules().items() if str(v).startswith(mine)}

    real = root.resolve()
    assert found == {
        "rlr_pkg": real / "rlr_pkg",
        "rlr_helper": real / "rlr_helper.py",
        "rlr_pkg_extra": real / "rlr_pkg_extra.py",
        spec_name: real / "configs",
    }
