"""The workers' environment on a cluster of several nodes (issue 50, item 1), on Ray's fake
multi-node cluster (ray.cluster_utils.Cluster: one head, one worker node with a custom resource
and a label, both on this machine): `raylane train --address` places its two workers as
`scaling.resources_per_worker`, `label_selector` and `placement_strategy` ask, each rank sees the
`env:` variables, and a secret passed by name (`${NAME}`) is written nowhere (MLflow's database,
the run's folder, the summary, the terminal, raylane's and Ray's logs); an accelerator type no
node has exits 2 in one line before any worker starts (on the test suite's shared head)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env

pytestmark = pytest.mark.ray
SECRET = "hf_e2e-secret-4f1c9a-never-written"
HELPER = REPO / "tests" / "helpers" / "env_probe.py"


@pytest.fixture
def two_nodes():
    """A head (1 CPU) and a worker node (2 CPUs, resource `fast`: 2, label pool=fast)."""
    from ray.cluster_utils import Cluster

    # A temp dir of its own (short: Ray's socket paths are limited) keeps Ray's "current cluster"
    # file of other runs on this machine as it is; no dashboard: its port may be taken (~60 s lost).
    temp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    common = {"num_gpus": 0, "temp_dir": temp}
    cluster = Cluster(
        initialize_head=True, connect=False, head_node_args={"num_cpus": 1, "include_dashboard": False, **common}
    )
    try:
        fast = cluster.add_node(num_cpus=2, resources={"fast": 2}, labels={"pool": "fast"}, **common)
        cluster.wait_for_nodes(timeout=60)
        yield cluster.address, fast.node_id, Path(temp)
    finally:
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def _project(tmp_path: Path) -> dict[str, str]:
    """The probe pipeline and a config asking for the `fast` node, with a secret by name; returns
    the CLI's environment, which holds the secret."""
    shutil.copy(HELPER, tmp_path / "pipe.py")
    (tmp_path / "run.yaml").write_text(
        "pipeline: ./pipe.py\n"
        "env:\n  HF_TOKEN: ${MY_SECRET}\n  PLAIN_SETTING: visible\n"
        "scaling:\n  num_workers: 2\n  resources_per_worker: {fast: 1}\n"
        "  label_selector: {pool: fast}\n  placement_strategy: STRICT_PACK\n"
    )
    return cli_env(tmp_path, MY_SECRET=SECRET)


@pytest.mark.untracked
@pytest.mark.shared_ray  # refused before any worker: the test suite's head (no GPU, no autoscaler) serves
def test_an_accelerator_type_no_node_has_exits_2_before_any_worker_starts(tmp_path, run_cli):
    env = _project(tmp_path)
    # What the suite's head can give: the fast node's resource and label aside.
    (tmp_path / "run.yaml").write_text(
        "pipeline: ./pipe.py\nenv:\n  HF_TOKEN: ${MY_SECRET}\nscaling:\n  num_workers: 2\n"
        f"  accelerator_type: H100\nmodel:\n  record: {tmp_path / 'seen'}\n"
    )
    refused = run_cli("train", "run.yaml", env=env)
    assert refused.wait(60) == 2, refused.output  # without the check: Ray Train waits for a node, then fails
    assert refused.output.strip().splitlines()[-1] == (
        "raylane: scaling.accelerator_type = 'H100': no node has it (the nodes have: none), and this cluster "
        "cannot add nodes (no autoscaler): no worker could start"
    )
    assert not (tmp_path / "seen").exists()  # no worker built the pipeline


@pytest.mark.slow  # ~50 s on 2 cores (a 2-worker run joining the cluster); the parts: tests/unit/test_worker_env.py
def test_workers_are_placed_as_asked_see_env_and_no_secret_is_written(tmp_path, run_cli, two_nodes):
    address, fast_node, session = two_nodes
    env = _project(tmp_path)
    sets = ["--set", "train.max_epochs=1", "--set", "mlflow.log_model=false", "--set", "mlflow.system_metrics=false"]
    run = run_cli(
        "train",
        "run.yaml",
        "--address",
        address,
        "--set",
        "model.watch=[HF_TOKEN,PLAIN_SETTING]",
        "--set",
        f"model.record={tmp_path / 'seen'}",
        "--summary-json",
        "summary.json",
        *sets,
        env=env,
    )
    assert run.wait(180) == 0, run.output
    ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / "seen").glob("rank-*.json"))]
    assert len(ranks) == 2
    assert {r["node"] for r in ranks} == {fast_node}  # both on the node with `fast` and pool=fast
    from tests.helpers.env_probe import fingerprint

    for r in ranks:
        assert r["env"] == {"HF_TOKEN": fingerprint(SECRET), "PLAIN_SETTING": fingerprint("visible")}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "FINISHED"

    import mlflow

    params = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(summary["run_id"]).data.params
    assert params["env.HF_TOKEN"] == "${MY_SECRET}" and params["env.PLAIN_SETTING"] == "visible"
    # Nowhere on disk: MLflow's database and artifacts, the run's folder (checkpoints, record),
    # the summary, both commands' output and raylane's log files, and the cluster's own logs.
    leaks = [
        str(p)
        for folder in (tmp_path, session)
        for p in folder.rglob("*")
        if p.is_file() and SECRET.encode() in p.read_bytes()
    ]
    assert leaks == []
