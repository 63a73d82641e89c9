"""What a user installs and imports: one top-level package, `raylane`, and its public API."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env
from tests.unit.test_public_api import PUBLIC


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # The wheel a `pip install .` would install (deps are the venv's; no network needed).
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
        cwd=out,
    )
    return next(out.glob("raylane-*.whl"))


def test_the_wheel_installs_raylane_alone_with_the_shipped_pipelines(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "bench" in n]  # the benchmarks stay in the repo (scripts/benchmarks)
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"raylane"}
    assert {
        "raylane/pipelines/digits.py",
        "raylane/pipelines/digits.yaml",
        "raylane/loop/trainer.py",
        "raylane/onray/launch.py",
        "raylane/tracking/runs.py",
        "raylane/autotuning/search.py",
        "raylane/loop/checkpoint/state.py",
        "raylane/hf/weights.py",
        "raylane/pipelines/hf.py",
        "raylane/pipelines/hf.yaml",
    } <= set(names)


def test_installed_package_imports_as_raylane_and_not_as_app(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    # bin/ holds the `raylane` command; every other top-level name would be importable.
    assert {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")} - {"bin"} == {"raylane"}
    code = (
        "import importlib.util, sys, raylane, raylane.pipelines.digits\n"
        "print(raylane.__file__)\n"
        "print([n for n in ('app', 'pipelines') if importlib.util.find_spec(n)])\n"
        "print(sorted(raylane.__all__))\n"
        "import raylane.hf\n"
        "print('torch' in sys.modules, 'ray' in sys.modules, 'transformers' in sys.modules)\n"
    )
    # -I: isolated mode, so neither the repo nor the editable install is on sys.path; the venv's
    # site-packages still provide the dependencies (pydantic, yaml).
    site = subprocess.run(
        [sys.executable, "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import sys; sys.path[:0] = [{str(target)!r}]; "
            f"sys.path.append({site!r}); sys.path = [p for p in sys.path if '__editable__' not in p]\n" + code,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    where, shadows, exported, heavy = out.stdout.splitlines()
    assert where.startswith(str(target))
    assert shadows == "[]"
    assert eval(exported) == sorted(PUBLIC)  # the installed wheel exports what the source tree promises
    assert (
        heavy == "False False False"
    )  # `import raylane` (and raylane.hf) pays for neither torch, Ray nor transformers


def test_python_api_trains_and_returns_the_summary(tmp_path):
    code = (
        "import raylane\n"
        "s = raylane.train('regression', ['train.max_steps=6', 'mlflow.enabled=false', "
        f"'run.storage_path={tmp_path / 'runs'}', 'run.name=api'], local=True)\n"
        "assert isinstance(s, raylane.TrainSummary) and s.exit_code == 0, s\n"
        "print('SUMMARY', s.model_dump_json())\n"
        "try:\n    raylane.train('regression', ['train.batch_size=0'])\n"
        "except raylane.ConfigError as e:\n    print('ERROR', e)\n"
        "try:\n    raylane.tune('no-such-sweep.yaml')\n"
        "except raylane.ConfigError as e:\n    print('ERROR', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=cli_env(tmp_path), timeout=300
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("SUMMARY "))[8:])
    assert summary["status"] == "FINISHED" and summary["steps"] == 6 and summary["run_name"] == "api"
    assert Path(summary["checkpoint"]).is_dir()
    errors = [line for line in out.stdout.splitlines() if line.startswith("ERROR ")]
    assert "train.batch_size = 0" in errors[0]
    assert "no-such-sweep.yaml" in errors[1]


def test_python_m_raylane_is_the_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "raylane", "check", "regression", "--set", "train.max_epochs=7"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "max_epochs: 7" in out.stdout
