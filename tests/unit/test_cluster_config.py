"""cluster.yaml against Ray's own cluster-config schema, and the promises its comments make."""

from __future__ import annotations

import copy

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
