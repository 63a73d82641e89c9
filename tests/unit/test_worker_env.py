"""The workers' environment in the config (issue 50, item 1): `scaling.accelerator_type`,
`resources_per_worker`, `placement_strategy`, `label_selector` and the top-level `env:`, whose
`${NAME}` values are read from the driver's environment at launch and recorded only as written.
In-process: the config, the resolution, what `raylane check` and a config's records show, and the
placement check's verdict on given nodes (tests/e2e/test_worker_env_e2e.py runs them on Ray)."""

from __future__ import annotations

import pytest

from raylane import cli
from raylane.config import ConfigError, load_config
from raylane.config.workerenv import apply_here, resolve
from raylane.onray import placement

SECRET = "hf_s3cr3t-value-never-recorded"


def _cfg(*sets: str):
    return load_config("regression", list(sets))


def test_placement_keys_reach_ray_trains_scaling_config():
    from ray.train import ScalingConfig

    cfg = _cfg(
        "scaling.accelerator_type=H100",
        "scaling.resources_per_worker.spot=0.5",
        "scaling.placement_strategy=STRICT_SPREAD",
        "scaling.label_selector.zone=in(a,b)",
    )
    scaling = ScalingConfig(num_workers=2, **placement.scaling_options(cfg))
    assert scaling.placement_strategy == "STRICT_SPREAD"
    assert scaling.label_selector == {"zone": "in(a,b)"}
    # Ray asks for the accelerator as a sliver of its `accelerator_type:` resource.
    assert scaling._resources_per_worker_not_none == {"CPU": 1.0, "spot": 0.5, "accelerator_type:H100": 0.001}
    plain = placement.scaling_options(_cfg())
    assert plain == {
        "resources_per_worker": {"CPU": 1.0},
        "placement_strategy": "PACK",
        "accelerator_type": None,
        "label_selector": None,
    }


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("env.RANK=3", "env.RANK = 3: set by the launcher"),
        ("env.RAY_ADDRESS=x", "env.RAY_ADDRESS = 'x': set by the launcher"),
        ("env.TOKEN=Bearer ${T}", "env.TOKEN = 'Bearer ${T}': only a whole value `${NAME}`"),
        ("env.FLAG=true", "env.FLAG = True: expected a string"),
        ("scaling.resources_per_worker.GPU=1", "scaling.resources_per_worker.GPU = 1.0: set by"),
        ("scaling.resources_per_worker.spot=0", "scaling.resources_per_worker.spot = 0.0: needs a name and 0 < amount"),
        ("scaling.placement_strategy=pack", "scaling.placement_strategy = 'pack': Input should be 'PACK'"),
        ("scaling.accelerator_type=H 100", "scaling.accelerator_type = 'H 100'"),
    ],
)
def test_a_bad_entry_is_one_line_naming_its_key(setting, says):
    with pytest.raises(ConfigError) as err:
        _cfg(setting)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_reference_is_read_from_the_drivers_environment_and_recorded_as_written(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    cfg = _cfg("env.HF_TOKEN=${HF_TOKEN}", "env.NCCL_DEBUG=INFO", "env.OMP_NUM_THREADS=2")
    assert cfg.env == {"HF_TOKEN": "${HF_TOKEN}", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "2"}
    assert resolve(cfg.env) == {"HF_TOKEN": SECRET, "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "2"}
    # What records the config (MLflow's params, the run's record, a checkpoint's manifest) holds the name.
    assert cfg.flat()["env.HF_TOKEN"] == "${HF_TOKEN}"
    assert SECRET not in repr(cfg.model_dump(mode="json"))
    for name in ("NCCL_DEBUG", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)  # restored after the test, as HF_TOKEN is
    apply_here(cfg.env)  # a torchrun rank, a --local run: this process's own environment
    import os

    assert os.environ["NCCL_DEBUG"] == "INFO" and os.environ["HF_TOKEN"] == SECRET


def test_check_shows_the_name_not_the_secret_and_an_unset_name_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert cli.main(["check", "regression", "--set", "env.HF_TOKEN=${HF_TOKEN}"]) == 0
    out = capsys.readouterr()
    assert "${HF_TOKEN}" in out.out and SECRET not in out.out + out.err
    monkeypatch.delenv("HF_TOKEN")
    assert cli.main(["check", "regression", "--set", "env.HF_TOKEN=${HF_TOKEN}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "raylane: env.HF_TOKEN = '${HF_TOKEN}': HF_TOKEN is not set in the driver's environment "
        "(export it where the run is launched)"
    )


NODES = [
    ({"CPU": 2, "accelerator_type:A100": 1, "spot": 4}, {"zone": "a", "ray.io/market-type": "spot"}),
    ({"CPU": 8}, {"zone": "b"}),
]


@pytest.mark.parametrize(
    ("sets", "says"),
    [
        (["scaling.accelerator_type=A100", "scaling.resources_per_worker.spot=4"], None),
        (["scaling.label_selector.zone=!a"], None),  # node b
        (["scaling.label_selector.zone=in(c,b)"], None),
        (["scaling.accelerator_type=H100"], "scaling.accelerator_type = 'H100': no node has it (the nodes have: A100)"),
        (
            ["scaling.resources_per_worker.spot=5"],
            "scaling.resources_per_worker.spot = 5: no node has that much (the most is 4)",
        ),
        (
            ["scaling.resources_per_worker.tpu=1"],
            "scaling.resources_per_worker.tpu = 1: no node has that much (the most is 0)",
        ),
        (
            ["scaling.label_selector.zone=!in(a,b)"],
            "scaling.label_selector.zone = '!in(a,b)': no node's label matches (the nodes have: a, b)",
        ),
    ],
)
def test_a_placement_no_node_satisfies_names_its_key(sets, says):
    assert placement.unplaceable(_cfg(*sets), NODES) == says


def test_a_cluster_may_grow_when_an_autoscaler_runs_node_types_of_a_config(monkeypatch):
    import json

    from raylane.onray import internals

    class NoConfig:
        def get_cluster_config(self):
            return None

    monkeypatch.setattr(internals, "ray_state", NoConfig(), raising=False)
    monkeypatch.delenv("RAY_enable_autoscaler_v2", raising=False)
    for active, grows in (({"node_" + "ab12" * 14: 1}, False), ({"ray.head.default": 1}, True), (None, False)):
        status = json.dumps({"autoscaler_report": {"active_nodes": active}}).encode() if active else None
        monkeypatch.setattr(internals, "internal_kv_get", lambda key, s=status: s, raising=False)
        assert placement._may_grow() is grows


def test_the_docs_example_is_a_valid_config_and_its_lines_are_raylanes(monkeypatch):
    import re

    import yaml

    from tests.conftest import REPO

    text = (REPO / "docs" / "clusters.md").read_text().split("### The workers' environment", 1)[1]
    example, *lines = re.findall(r"^```(?:yaml)?\n(.*?)^```", text, re.S | re.M)[:3]
    monkeypatch.setenv("HF_TOKEN", SECRET)
    cfg = load_config({"pipeline": "regression", **yaml.safe_load(example)})
    assert cfg.env["HF_TOKEN"] == "${HF_TOKEN}" and cfg.scaling.label_selector == {"ray.io/market-type": "spot"}
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ConfigError) as err:
        resolve(cfg.env)
    assert lines[0].strip() == f"raylane: {err.value}"
    why = placement.unplaceable(cfg, [({"CPU": 8, "GPU": 8, "accelerator_type:A100": 1, "spot": 8}, {})])
    assert lines[1].strip().startswith(f"raylane: {why}, and this cluster cannot add nodes")


def test_each_worker_gets_env_before_its_process_group(monkeypatch):
    """RaylaneTorchBackend.on_start: the variables first (NCCL_* and GLOO_* are read as the process
    group starts), then Ray's own start, which makes the group."""
    from raylane.onray import trainers
    from raylane.onray.internals import TorchBackend

    calls = []

    class Group:
        def execute(self, fn, *args):
            calls.append((fn.__name__, args))

    monkeypatch.setattr(TorchBackend, "on_start", lambda self, group, config: calls.append(("process_group", ())))
    values = {"NCCL_DEBUG": "INFO"}
    trainers.RaylaneTorchBackend().on_start(Group(), trainers.RaylaneTorchConfig(env=values))
    assert calls == [("set_env", (values,)), ("process_group", ())]
    calls.clear()
    trainers.RaylaneTorchBackend().on_start(Group(), trainers.RaylaneTorchConfig())
    assert calls == [("process_group", ())]  # no env: nothing extra on the workers
