"""`strategy.tp: auto` measures each layout on fake process groups inside the training processes,
and each torchrun rank runs the forward check on a fake group before its own: under torchrun on
2 ranks, `tp: auto` choosing tp2 trains gpt-tiny exactly as the same layout given explicitly,
both with the forward check on every rank (raylane.loop.distributed.fake.fake_work). The explicit layout
against one process (within 1e-6, with the check on the ranks too): test_strategies'
test_tensor_parallel_matches_one_rank_and_its_checkpoint_loads_in_one_process. And what the
forward check finds, each rank refuses before its process group."""

from __future__ import annotations

import sqlite3

import yaml

from tests.conftest import REPO, TORCHRUN, cli_env, read_json

STEPS = 4
SETS = {
    "train.max_steps": STEPS,
    "mlflow.log_every_n_steps": 1,
    "mlflow.log_model": "false",
    "checkpoint.every_n_steps": 0,
    "train.eval_every_n_steps": 0,
    "optim.name": "sgd",
    "optim.lr": 0.3,
    "strategy.name": "fsdp",
    "strategy.sequence_parallel": "true",
    "strategy.loss_parallel": "true",
}


def _losses(db, run_id: str) -> dict[int, float]:
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT step, value FROM metrics WHERE run_uuid = ? AND key = 'train/loss'", (run_id,))
        return dict(rows)


def test_tp_auto_choosing_tp2_trains_as_explicit_tp2(run_cli, tmp_path):
    """The same train loss at every step, bit for bit, and the same layout. Seen failing before
    fake_work: tp: auto's ranks ran on the measurement's fake groups (nothing sent), 5.5173
    against 5.4992 at step 1."""
    layouts = {"explicit": ["strategy.tp=2"], "auto": ["strategy.tp=auto", "scaling.device_memory_gb=0.000001"]}
    started = {
        name: run_cli(
            *["--nproc_per_node", "2", "-m", "raylane", "train", "gpt-tiny"],
            *[x for s in [*(f"{k}={v}" for k, v in SETS.items()), *sets, f"run.name={name}"] for x in ("--set", s)],
            *["--summary-json", f"{name}.json"],
            launcher=TORCHRUN,
            name=name,
        )
        for name, sets in layouts.items()
    }
    runs = {}
    for name, p in started.items():
        assert p.wait(300) == 0, p.output
        runs[name] = read_json(tmp_path / f"{name}.json")
    assert "strategy tp2+sp+lp (tp auto: per rank FSDP ~" in started["auto"].output, started["auto"].output
    assert runs["auto"]["strategy"] == runs["explicit"]["strategy"] == "tp2+sp+lp"
    losses = {name: _losses(tmp_path / "mlflow.db", run["run_id"]) for name, run in runs.items()}
    assert sorted(losses["explicit"]) == list(range(1, STEPS + 1))
    assert losses["auto"] == losses["explicit"], losses


def test_under_torchrun_a_forward_no_rank_can_run_is_refused_before_the_process_group(run_cli, tmp_path):
    """nanoGPT's `C // self.n_heads` under tp2 (tests/helpers/natural_gpt.py): rank 0 prints the
    forward check's one line, every rank exits 2, nothing is recorded. Before, the ranks left the
    forward check to the first step: the run started, opened its MLflow run and failed there."""
    body = {
        "pipeline": str(REPO / "tests/helpers/natural_gpt.py"),
        "model": {"n_layer": 2, "head_dim_from_input": True},
        "strategy": {"name": "fsdp", "tp": 2},
    }
    (tmp_path / "natural.yaml").write_text(yaml.safe_dump(body))
    p = run_cli(
        *["--nproc_per_node", "2", "-m", "raylane", "train", "natural.yaml"],
        launcher=TORCHRUN,
        env=cli_env(tmp_path, new_database=False),
    )
    assert p.wait(timeout=240) != 0, p.output
    mine = [x for x in p.output.splitlines() if x.startswith("raylane: ")]
    assert len(mine) == 1 and mine[0].startswith(
        "raylane: strategy.tp = 2: TinyLM's forward fails in blocks.0.attn ("
    ), p.output
    assert "view them with -1 heads" in mine[0]
    assert "exitcode  : 2" in p.output and "exitcode  : 1" not in p.output, p.output
    assert not (tmp_path / "mlflow.db").exists() and not list((tmp_path / "runs").glob("*/*"))
