"""Every node's health in MLflow (issue 51, item 4): two torchrun "nodes" on this machine (two
launches, --nnodes 2, one rank each, named node-0 and node-1 by RAYLANE_NODE_NAME as two hosts'
names would), each node's sampler on its local rank 0, at mlflow.system_metrics_interval_s = 1.
Rank 0's node alone talks to MLflow: node-1's samples reach it through the run's folder. The same
on Ray: a fake multi-node cluster (ray.cluster_utils.Cluster, two raylets on this machine named
node-a and node-b by RAYLANE_NODE_NAME in each raylet's environment), a 2-worker run placed one
worker per node. The sampler, the watch and a silent node in-process: tests/unit/test_health.py."""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, TORCHRUN, cli_env, free_port, read_json

RAY_NODES = ("node-a", "node-b")

HELPER = REPO / "tests" / "helpers" / "slow_loader.py"
# No GPU here: CPU, memory, the run folder's disk and the network, of every node.
FIELDS = {"cpu_percent", "memory_percent", "memory_used_gb", "disk_percent", "disk_free_gb"} | {
    "network_receive_mb_s",
    "network_transmit_mb_s",
}


def _steps(db: Path, run_id: str) -> dict[str, list[int]]:
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT key, step FROM metrics WHERE run_uuid = ? ORDER BY step", (run_id,)).fetchall()
    out: dict[str, list[int]] = {}
    for key, step in rows:
        out.setdefault(key, []).append(step)
    return out


@pytest.mark.slow  # ~26 s on 2 busy cores: one node's health is checked in make test by test_observability.py
def test_two_nodes_health_lands_in_mlflow_under_each_nodes_name(run_cli, tmp_path):
    shutil.copy(HELPER, tmp_path / "pipe.py")
    (tmp_path / "cfg.yaml").write_text("pipeline: ./pipe.py\n")
    sets = [
        "train.batch_size=16",
        "train.max_epochs=1",
        "model.sleep_s=0.25",  # 16 steps of ~0.25 s: ~4 s of training, a sample a second
        "mlflow.log_model=false",
        "mlflow.system_metrics_interval_s=1",
        "mlflow.system_metrics_silent_after=5",
        f"run.storage_path={tmp_path / 'runs'}",
        "run.name=health",
    ]
    port = free_port()
    nodes = [
        run_cli(
            *("--nnodes", "2", "--node_rank", str(n), "--nproc_per_node", "1"),
            *("--master_addr", "127.0.0.1", "--master_port", str(port)),
            *("-m", "raylane", "train", "cfg.yaml"),
            *[x for item in sets for x in ("--set", item)],
            *(["--summary-json", "s.json"] if n == 0 else []),
            launcher=TORCHRUN[:-1],
            env=cli_env(tmp_path, RAYLANE_NODE_NAME=f"node-{n}"),
            name=f"node{n}",
        )
        for n in (0, 1)
    ]
    for p in nodes:
        assert p.wait(180) == 0, p.output
    s = read_json(tmp_path / "s.json")
    steps = _steps(tmp_path / "mlflow.db", s["run_id"])
    for node in ("node-0", "node-1"):
        keys = {k.split("/")[-1] for k in steps if k.startswith(f"system/{node}/")}
        assert keys == FIELDS, (node, sorted(steps))
        # At the interval set: a point a second (the step is the sample's unix second).
        at = steps[f"system/{node}/cpu_percent"]
        gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
        assert len(at) >= 3 and all(1 <= g <= 3 for g in gaps), (node, at)
    assert not {k.split("/")[1] for k in steps if k.count("/") == 2} - {"node-0", "node-1"}  # keys by node, not rank
    # Each node's file in the run's folder holds its last samples; no node fell silent.
    assert {p.name for p in (tmp_path / "runs" / "health" / "health").iterdir()} == {"node-0.json", "node-1.json"}
    assert "has sent no health sample" not in nodes[0].output


@pytest.fixture
def two_named_nodes():
    """A head and a second raylet on this machine, 2 CPUs each, each raylet (and so every worker
    it starts) with its own RAYLANE_NODE_NAME, as two hosts' names would differ."""
    from ray.cluster_utils import Cluster

    # A temp dir of its own (short: Ray's socket paths are limited); no dashboard: its port may be taken.
    temp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    common = {"num_cpus": 2, "num_gpus": 0, "temp_dir": temp}
    head = {"include_dashboard": False, "env_vars": {"RAYLANE_NODE_NAME": RAY_NODES[0]}, **common}
    cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
    try:
        cluster.add_node(env_vars={"RAYLANE_NODE_NAME": RAY_NODES[1]}, **common)
        cluster.wait_for_nodes(timeout=60)
        yield cluster.address
    finally:
        cluster.shutdown()  # every process it started, by its own handles
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow  # ~60 s on 2 busy cores (a 2-worker Ray run joining a 2-node cluster); torchrun's above
@pytest.mark.ray
def test_on_a_fake_two_node_ray_cluster_each_nodes_health_lands_under_its_name(run_cli, tmp_path, two_named_nodes):
    shutil.copy(HELPER, tmp_path / "pipe.py")
    (tmp_path / "cfg.yaml").write_text("pipeline: ./pipe.py\n")
    sets = [
        "scaling.num_workers=2",
        "scaling.placement_strategy=STRICT_SPREAD",  # one worker on each node
        "train.batch_size=16",
        "train.max_epochs=1",
        "mlflow.log_model=false",
        "mlflow.system_metrics_interval_s=1",
        f"run.storage_path={tmp_path / 'runs'}",
    ]
    # 16 steps of ~0.25 s on every rank (a slow loader, through the fault plan): a sample a second.
    env = cli_env(tmp_path, RAYLANE_FAULTS="slowdata@ms=250")
    run = run_cli(
        *("train", "cfg.yaml", "--address", two_named_nodes, "--summary-json", "s.json"),
        *[x for item in sets for x in ("--set", item)],
        env=env,
    )
    assert run.wait(240) == 0, run.output
    s = read_json(tmp_path / "s.json")
    steps = _steps(tmp_path / "mlflow.db", s["run_id"])
    for node in RAY_NODES:
        keys = {k.split("/")[-1] for k in steps if k.startswith(f"system/{node}/")}
        assert keys == FIELDS, (node, sorted(steps))
        assert len(steps[f"system/{node}/cpu_percent"]) >= 2, (node, steps[f"system/{node}/cpu_percent"])
    assert {k.split("/")[1] for k in steps if k.startswith("system/") and k.count("/") == 2} == set(RAY_NODES)
    assert "has sent no health sample" not in run.output
