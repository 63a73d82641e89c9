"""A user's own decoder written the natural way (nanoGPT's shape, tests/helpers/natural_gpt.py:
`B, T = idx.shape`, a position embedding of `arange(T)`, attentions viewed by `self.n_heads`, a
dict tp_plan) trained with `raylane train` under torchrun on 2 ranks, tp2 and pp2, against one
process: the same train loss at every step. And the forward no rank's share of the plan can run
(the head size from the input's width) refused before launch in one line."""

from __future__ import annotations

import sqlite3

import pytest
import yaml

from tests.conftest import REPO, TORCHRUN, read_json

PIPELINE = str(REPO / "tests/helpers/natural_gpt.py")
STEPS = 4


def _config(tmp_path, **model) -> str:
    path = tmp_path / "natural.yaml"
    body = {
        "pipeline": PIPELINE,
        "model": {"n_layer": 2, **model},
        "optim": {"name": "sgd", "lr": 0.5, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0},
        "train": {"batch_size": 8, "max_steps": STEPS, "eval_every_n_steps": 0},
        "checkpoint": {"every_n_steps": 0},
        "mlflow": {"log_every_n_steps": 1, "log_model": False},
    }
    path.write_text(yaml.safe_dump(body))
    return str(path)


def _losses(db, run_id: str) -> dict[int, float]:
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT step, value FROM metrics WHERE run_uuid = ? AND key = 'train/loss'", (run_id,))
        return dict(rows)


def test_a_natural_decoder_trains_under_tp_and_pp_as_on_one_process(run_cli, tmp_path):
    """tp2 (its 4 heads viewed as 2 on each rank: raylane divides `n_heads` on each split attention)
    and pp2 (the later stage runs the model's forward on the model's own input, so `B, T =
    idx.shape` holds) each log one process's train loss within 1e-6 at every step, and are named
    so. Seen failing before the fix: tp2 stopped at the first step with `shape '[8, 16, 4, 8]' is
    invalid for input of size 2048`, pp2 with `too many values to unpack (expected 2)` on rank 1."""
    config = _config(tmp_path)
    layouts = {"tp": ["strategy.tp=2", "strategy.name=fsdp"], "pp": ["strategy.pp=2"]}
    started = {
        name: run_cli(
            *["--nproc_per_node", "2", "-m", "raylane", "train", config],
            *[x for s in [*sets, f"run.name={name}"] for x in ("--set", s)],
            *["--summary-json", f"{name}.json"],
            launcher=TORCHRUN,
            name=name,
        )
        for name, sets in layouts.items()
    }
    started["one"] = run_cli(
        *["train", config, "--local", "--set", "scaling.num_workers=1", "--set", "run.name=one"],
        *["--summary-json", "one.json"],
        name="one",
    )
    runs = {}
    for name, p in started.items():
        assert p.wait(400) == 0, p.output
        runs[name] = read_json(tmp_path / f"{name}.json")
    assert (runs["tp"]["strategy"], runs["pp"]["strategy"]) == ("tp2", "pp2")
    one = _losses(tmp_path / "mlflow.db", runs["one"]["run_id"])
    assert sorted(one) == list(range(1, STEPS + 1)), one
    assert one[STEPS] < one[1]  # it learns
    for name in ("tp", "pp"):
        mine = _losses(tmp_path / "mlflow.db", runs[name]["run_id"])
        assert sorted(mine) == sorted(one), (name, mine)
        worst = max(abs(mine[s] - v) / v for s, v in one.items())
        assert worst <= 1e-6, (name, worst, mine, one)


def _train(capsys, config: str, *sets: str) -> tuple[int, str]:
    from raylane import cli

    capsys.readouterr()
    code = cli.main(["train", config, *(x for s in sets for x in ("--set", s))])
    return code, capsys.readouterr().err.strip()


def test_what_a_layout_cannot_run_is_refused_before_launch(tmp_path, capsys, no_work):
    """Before any worker starts, one line, exit 2: nanoGPT's own `C // self.n_heads` (a head
    size from the input's whole width, which no rank's share of the heads satisfies) under tp2,
    naming the attention, the user's file:line and what the forward must do; a dict plan with
    strategy.sequence_parallel (before: trained as plain tp2, named `tp2+sp`). The natural
    forward of the test above passes the same checks (here: no_work stops it once they pass)."""
    workers = ["scaling.num_workers=2", "strategy.name=fsdp"]
    code, err = _train(capsys, _config(tmp_path, head_dim_from_input=True), *workers, "strategy.tp=2")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("raylane: strategy.tp = 2: TinyLM's forward fails in blocks.0.attn (")
    assert f"{PIPELINE}:" in err and "view them with -1 heads" in err
    config = _config(tmp_path)
    code, err = _train(capsys, config, *workers, "strategy.tp=2", "strategy.sequence_parallel=true")
    assert code == 2 and err.startswith(
        "raylane: strategy.sequence_parallel = True: the pipeline's tp_plan is a dict; "
    ), err
    for layout in ("strategy.tp=2", "strategy.pp=2"):
        with pytest.raises(AssertionError, match="got past the checks"):
            _train(capsys, config, *workers, layout)
