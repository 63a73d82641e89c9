"""cluster.yaml against Ray's own cluster-config schema, and the promises its comments make; its
image against the client (torch installed, the same Ray); the commands it runs on its nodes and
the docs' commands for it, as far as they run without a cloud account (Ray's CLI stubbed, its
parser real)."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO


def _load() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_cluster_yaml_passes_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(_load()))


def test_a_typo_in_cluster_yaml_fails_the_schema():
    from jsonschema import ValidationError
    from ray.autoscaler._private.util import prepare_config, validate_config

    bad = copy.deepcopy(_load())
    bad["available_node_types"]["gpu_p5"]["min_wrkers"] = 0
    with pytest.raises(ValidationError, match="min_wrkers"):
        validate_config(prepare_config(bad))


def test_cluster_yaml_scales_gpus_from_zero_with_token_auth_and_no_secrets():
    cfg = _load()
    assert cfg["docker"]["image"] == "rayproject/ray:2.60.0-py311-gpu"
    workers = {k: v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"]}
    assert workers and all(v["min_workers"] == 0 and v["max_workers"] > 0 for v in workers.values())
    assert cfg["available_node_types"][cfg["head_node_type"]]["resources"] == {"CPU": 0}
    starts = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)
    assert any("mlflow server" in c for c in cfg["head_start_ray_commands"])
    # The token travels from the user's machine at start; the repo holds none.
    assert cfg["file_mounts"]["/home/ray/.ray/auth_token"] == "~/.ray/auth_token"
    assert {".venv", "mlflow.db", "runs"} <= set(cfg["rsync_exclude"])
    assert "pip install" in " ".join(cfg["setup_commands"])


# --- the image and its pins, as `ray up` will use them -------------------------------------------

IMAGE = re.compile(r"rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-py(?P<py>\d)(?P<minor>\d+)-gpu")


def _pins(cfg: dict) -> dict[str, str]:
    """package -> version of every `name==version` that the setup commands install."""
    text = " ".join(cfg.get("setup_commands", []))
    return {
        m["name"].lower(): m["version"] for m in re.finditer(r"(?P<name>[A-Za-z][\w.-]*)==(?P<version>[\w.+]+)", text)
    }


def image_problems(cfg: dict) -> list[str]:
    """What keeps cluster.yaml's nodes from running raylane as this client would: Ray's GPU image
    carries CUDA but no torch (kuberay-notes §0.2), so the setup commands must install the torch
    raylane pins before raylane; the image's Ray must be the client's (`ray up`, `ray job submit`
    and a joining driver refuse another) and one raylane's own range admits. One line each."""
    import ray
    import torch
    from packaging.requirements import Requirement

    problems = []
    image = cfg.get("docker", {}).get("image", "")
    m = IMAGE.fullmatch(image)
    if not m:
        return [f"docker.image = {image!r}: not a rayproject/ray:<version>-py<python>-gpu tag"]
    if m["ray"] != ray.__version__:
        problems.append(f"docker.image = {image!r}: Ray {m['ray']}, the client has Ray {ray.__version__}")
    dependency = re.search(r'"(ray\[[^"]*)"', (REPO / "pyproject.toml").read_text())[1]
    ray_range = Requirement(dependency).specifier
    if m["ray"] not in ray_range:
        problems.append(f"docker.image = {image!r}: Ray {m['ray']} is outside raylane's ray{ray_range}")
    pinned = (REPO / "constraints-cpu.txt").read_text().split("torch==")[1].split()[0]
    setup = cfg.get("setup_commands", [])
    torch_at = next((i for i, c in enumerate(setup) if "torch==" in c), None)
    raylane_at = next((i for i, c in enumerate(setup) if "/home/ray/raylane" in c), None)
    if torch_at is None:
        problems.append(f"setup_commands: no `pip install torch=={pinned}`: the image has no torch")
    elif _pins(cfg)["torch"] != pinned or pinned != torch.__version__.split("+")[0]:
        problems.append(
            f"setup_commands: torch=={_pins(cfg)['torch']}, raylane pins torch=={pinned} (the client has {torch.__version__})"
        )
    elif raylane_at is None or raylane_at < torch_at:
        problems.append("setup_commands: raylane is installed before the pinned torch (pip would pick its own)")
    if "ray" in _pins(cfg) and _pins(cfg)["ray"] != m["ray"]:
        problems.append(f"setup_commands: ray=={_pins(cfg)['ray']} replaces the image's Ray {m['ray']}")
    return problems


def test_cluster_yaml_image_holds_the_pinned_torch_and_the_clients_ray():
    assert image_problems(_load()) == []


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda c: c["docker"].update(image="rayproject/ray:2.59.0-py311-gpu"), "Ray 2.59.0, the client has Ray"),
        (lambda c: c["docker"].update(image="rayproject/ray:latest-gpu"), "not a rayproject/ray:<version>"),
        (lambda c: c.update(setup_commands=["pip install -q -e /home/ray/raylane"]), "the image has no torch"),
        (lambda c: c["setup_commands"].__setitem__(0, "pip install -q torch==2.6.0"), "torch==2.6.0, raylane pins"),
        (lambda c: c["setup_commands"].reverse(), "raylane is installed before the pinned torch"),
        (lambda c: c["setup_commands"].append("pip install -q ray==2.59.0"), "ray==2.59.0 replaces the image's"),
    ],
)
def test_each_image_problem_is_one_line(edit, problem):
    cfg = copy.deepcopy(_load())
    edit(cfg)
    found = image_problems(cfg)
    assert len(found) == 1 and problem in found[0], found


# --- the commands cluster.yaml runs on its nodes, and the docs' commands for it ------------------


def _ray_accepts(argv: list[str]) -> dict:
    """Ray's own CLI parser (click) on `ray ARGV`: its parameters, or click's UsageError."""
    import click
    from ray.scripts.scripts import cli

    ctx, (name, *rest) = cli.make_context("ray", list(argv)), argv
    command = cli.get_command(ctx, name)
    assert command is not None, f"ray {name}: no such command"
    if isinstance(command, click.Group):
        ctx, command, (name, *rest) = (
            command.make_context(name, rest, parent=ctx),
            command.get_command(ctx, rest[0]),
            rest,
        )
        assert command is not None, f"ray {argv[0]} {name}: no such command"
    return command.make_context(name, rest, parent=ctx).params


def test_the_nodes_start_commands_parse_with_ray_and_mlflow():
    """`ray start` on the head and the workers parse with the client's Ray (whose version the
    image's matches); the head's `mlflow server` uses only flags that scripts/mlflow-server.sh
    passes to the client's MLflow, which the e2e tests start for real (mlflow.cli itself takes
    ~5 s to import)."""
    cfg = _load()
    served = re.findall(r"(--[a-z-]+)", (REPO / "scripts" / "mlflow-server.sh").read_text().split("exec ")[-1])
    for command in cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]:
        argv = shlex.split(command.split("&&")[-1].split(">")[0])
        argv = argv[next(i for i, a in enumerate(argv) if a in ("ray", "mlflow")) :]  # after VAR=value
        if argv[0] == "ray":
            _ray_accepts(argv[1:])
        else:
            assert argv[1] == "server" and {a for a in argv if a.startswith("--")} <= set(served), argv
            assert argv[argv.index("--host") + 1] == "0.0.0.0"  # the workers log to it over the private network


STUB_RAY = """#!/usr/bin/env bash
# Records each call (NUL-separated argv, one call a line); answers as Ray's launcher does on AWS.
printf '%s\\0' "$@" >> "$RAY_CALLS"; echo >> "$RAY_CALLS"
case "$1" in
  get-head-ip) echo "Fetched IP: 203.0.113.7"; echo 203.0.113.7 ;;  # the public address
  exec) echo "Fetched IP: 203.0.113.7"; echo "10.0.1.23 172.17.0.1" ;;  # hostname -I on the head
esac
"""


def _docs_block() -> list[list[str]]:
    """docs/clusters.md's `scripts/cluster.sh` block, command by command (VAR=value kept)."""
    from tests.e2e.test_readme import blocks, commands

    found = [b for b in blocks(REPO / "docs" / "clusters.md") if "scripts/cluster.sh up" in b.text]
    assert len(found) == 1
    return commands(found[0])


def test_the_docs_cluster_commands_run_as_far_as_they_can_without_a_cloud(tmp_path):
    """Every command of docs/clusters.md's cluster.yaml block runs for real, with Ray's CLI
    replaced by a stub that records its calls (no cloud account here): `token` writes a token
    once, `up` refuses without one, and what each verb hands Ray parses with Ray's own CLI; the
    job `submit` sends runs raylane's parser and config loader on its entrypoint, keeps local
    state out of the upload, sends checkpoints to the bucket and metrics to an MLflow host that
    MLflow's host check admits."""
    from tests.e2e.test_readme import check_raylane, split_env

    stub = tmp_path / "ray"
    stub.write_text(STUB_RAY)
    stub.chmod(0o755)
    calls = tmp_path / "calls"
    env = {**os.environ, "HOME": str(tmp_path), "RAY": str(stub), "RAY_CALLS": str(calls)}
    env.pop("RAY_ADDRESS", None)
    script = [str(REPO / "scripts" / "cluster.sh")]
    up = subprocess.run([*script, "up"], env=env, capture_output=True, text=True, timeout=30)
    assert up.returncode == 2 and up.stderr.strip() == "cluster.sh: no ~/.ray/auth_token; run: scripts/cluster.sh token"
    seen = []
    for argv in _docs_block():
        assigned, argv = split_env(argv)
        assert argv[0] == "scripts/cluster.sh", argv
        out = subprocess.run(
            [*script, *argv[1:]],
            env={**env, **dict(a.split("=", 1) for a in assigned)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, (argv, out.stderr)
        seen.append(argv[1])
    assert seen == ["token", "up", "tunnel", "submit", "logs", "down"]
    token = tmp_path / ".ray" / "auth_token"
    assert re.fullmatch(r"[0-9a-f]{64}\n", token.read_text()) and token.stat().st_mode & 0o777 == 0o600
    before = token.read_text()
    subprocess.run([*script, "token"], env=env, check=True, capture_output=True, timeout=30)
    assert token.read_text() == before  # a second `token` keeps the one the cluster has

    made = [line.split("\0")[:-1] for line in calls.read_text().split("\n") if line]
    assert [c[0] for c in made] == ["up", "attach", "exec", "job", "job", "down"], made
    for call in made:
        params = _ray_accepts(call)
        if call[0] in ("up", "attach", "exec", "down"):
            assert params["cluster_config_file"] == "cluster.yaml"  # the file the schema tests check
    submit = next(c for c in made if c[:2] == ["job", "submit"])
    entrypoint = _ray_accepts(submit)["entrypoint"]
    assert entrypoint[:2] == ("raylane", "train")
    check_raylane(list(entrypoint[1:]), REPO)  # parses, and the config loads with every --set
    assert "run.storage_path=s3://your-bucket/raylane" in entrypoint
    runtime_env = json.loads(submit[submit.index("--runtime-env-json") + 1])
    assert {".venv", "runs", "mlflow.db"} <= set(runtime_env["excludes"])
    uri = runtime_env["env_vars"]["MLFLOW_TRACKING_URI"]
    assert uri == "http://10.0.1.23:5000", uri
    mlflow_hosts = _mlflow_security_utils()
    assert mlflow_hosts.is_allowed_host_header(mlflow_hosts.get_default_allowed_hosts(), uri.removeprefix("http://"))
    assert not mlflow_hosts.is_allowed_host_header(mlflow_hosts.get_default_allowed_hosts(), "203.0.113.7:5000")


def _mlflow_security_utils():
    """MLflow's own host-header check (mlflow/server/security_utils.py), loaded alone: imported
    through its package, mlflow.server would load the whole server (~3 s)."""
    import importlib.util

    import mlflow

    spec = importlib.util.spec_from_file_location(
        "mlflow_security_utils", Path(mlflow.__file__).parent / "server" / "security_utils.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
