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
    (root / "mypkg" / "sub").mkdir(parents=True)
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "sub" / "__init__.py").write_text("")
    (root / "helper.py").write_text("X = 1\n")
    (root / "configs").mkdir()
    (root / "configs" / "pipe.py").write_text("Y = 2\n")
    (root / "mypkg_extra.py").write_text("")  # a name that starts like the package's
    elsewhere.mkdir()
    (elsewhere / "outside.py").write_text("")
    pipelines_ref.add_root(root)
    sys.path.append(str(elsewhere))
    for name in ("mypkg.sub", "helper", "outside", "mypkg_extra"):
        __import__(name)
    spec_name = pipelines_ref.FILE_MODULE_PREFIX + "pipe_0"
    spec = importlib.util.spec_from_file_location(spec_name, root / "configs" / "pipe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec_name] = module
    spec.loader.exec_module(module)

    found = pipelines_ref.user_modules()

    real = root.resolve()
    assert found == {
        "mypkg": real / "mypkg",
        "helper": real / "helper.py",
        "mypkg_extra": real / "mypkg_extra.py",
        spec_name: real / "configs",
    }
