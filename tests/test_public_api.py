"""raylane's public API: the names users build on stay, and the shipped pipelines use only them,
as a user's pipeline would (everything else, raylane.loop and the rest, may change)."""

from __future__ import annotations

from pathlib import Path

import pytest

import raylane
import raylane.hf

# The promise, written out: removing or renaming one of these breaks users' code.
PUBLIC = {"BaseConfig", "ConfigError", "DataError", "FileSource", "Hook", "HookContext", "InputPath", "InputPaths",
          "OutputPath", "Pipeline", "Section", "StepFn", "__version__", "autotune", "check", "down", "submit", "train",
          "tune", "up"}
PUBLIC_HF = {"Config", "DataSection", "ModelSection", "empty_model", "file_source", "load_pretrained", "pipeline"}


@pytest.mark.parametrize(("module", "promised"), [(raylane, PUBLIC), (raylane.hf, PUBLIC_HF)],
                         ids=["raylane", "raylane.hf"])
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

