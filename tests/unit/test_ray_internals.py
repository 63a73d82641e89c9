"""Ray's internals that raylane uses are all in raylane.onray.internals, and each still resolves
on the installed Ray: a Ray upgrade that moves one fails here, naming it, not in a user's run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from raylane.onray import internals

APP = Path(internals.__file__).resolve().parents[1]
# A dotted name with a private part, except torch's own (its fake process group: raylane.loop.distributed.layout).
PRIVATE = re.compile(r"(?<![\w.])(?!torch\.)(?:ray|_?ray_\w*)?[\w.]*\._(?:internal|private)\b|\b_TorchBackend\b")


@pytest.mark.parametrize("name", sorted(internals.NAMES))
def test_each_private_name_resolves(name):
    module, attribute, why = internals.NAMES[name]
    try:
        internals.resolve(module, attribute)
    except (ImportError, AttributeError) as exc:
        pytest.fail(
            f"Ray {_ray_version()} has no {module}{'.' + attribute if attribute else ''} "
            f"(raylane.onray.internals.{name}: {why}): {exc}"
        )
    assert getattr(internals, name) is internals.resolve(module, attribute)


@pytest.mark.parametrize("member", internals.MEMBERS, ids=[f"{m}:{a}" for m, a, _ in internals.MEMBERS])
def test_each_private_member_raylane_overrides_or_reads_exists(member):
    module, dotted, why = member
    try:
        internals.resolve(module, dotted)
    except (ImportError, AttributeError) as exc:
        pytest.fail(f"Ray {_ray_version()} has no {module}.{dotted} ({why}): {exc}")


@pytest.mark.parametrize("entry", internals.SET_BY, ids=[e[2] for e in internals.SET_BY])
def test_each_private_attribute_raylane_reads_is_still_set(entry):
    import inspect

    module, method, attribute, why = entry
    source = inspect.getsource(internals.resolve(module, method))
    assert f"self.{attribute} =" in source, (
        f"Ray {_ray_version()}: {module}.{method} no longer sets {attribute} ({why})"
    )


def test_no_other_module_names_rays_internals():
    found = [
        f"{path.relative_to(APP)}:{n}: {line.strip()}"
        for path in sorted(APP.rglob("*.py"))
        if path.name != "internals.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line) and not line.lstrip().startswith("#")
    ]
    assert not found, "Ray internals named outside raylane.onray.internals:\n" + "\n".join(found)


def test_the_installed_ray_is_one_the_names_were_checked_on():
    assert _ray_version() in internals.CHECKED_ON, (
        f"Ray {_ray_version()}: raylane.onray.internals was checked on {', '.join(internals.CHECKED_ON)}; "
        "run this module's tests on it and add it to CHECKED_ON"
    )


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        internals.Nope  # noqa: B018


def _ray_version() -> str:
    import ray

    return ray.__version__
