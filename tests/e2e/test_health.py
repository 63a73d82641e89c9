"""Every node's health in MLflow (issue 51, item 4): two torchrun "nodes" on this machine (two
launches, --nnodes 2, one rank each, named node-0 and node-1 by RAYLANE_NODE_NAME as two hosts'
names would), each node's sampler on its local rank 0, at mlflow.system_metrics_interval_s = 1.
Rank 0's node alone talks to MLflow: node-1's samples reach it through the run's folder. The
sampler, the watch and a silent node in-process: tests/unit/test_health.py."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import REPO, TORCHRUN, cli_env, free_port, read_json

HELPER = REPO / "tests" / "helpers" / "slow_loader.py"
FIELDS = {"cpu_percent", "memory_percent", "memory_used_gb"}


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
        assert keys == FIELDS, (node, sorted(steps))  # no GPU here: CPU and memory only
        # At the interval set: a point a second (the step is the sample's unix second).
        at = steps[f"system/{node}/cpu_percent"]
        gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
        assert len(at) >= 3 and all(1 <= g <= 3 for g in gaps), (node, at)
    assert not {k.split("/")[1] for k in steps if k.count("/") == 2} - {"node-0", "node-1"}  # keys by node, not rank
    # Each node's file in the run's folder holds its last samples; no node fell silent.
    assert {p.name for p in (tmp_path / "runs" / "health" / "health").iterdir()} == {"node-0.json", "node-1.json"}
    assert "has sent no health sample" not in nodes[0].output
