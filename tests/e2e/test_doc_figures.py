"""The figures README.md and docs/hf.md quote for the examples, reproduced by the commands printed
beside them, as a reader on a fresh clone runs them: `make run`'s digits run (README's outcome
block) and examples/hf-finetune (make_model.py tiny, the full fine-tune, its export, the LoRA run
on it). Each figure is read from the page by a pattern, so a page that changes its numbers is
checked against the run, and a page that drops the sentence fails here until this list follows.

Tolerances, stated per figure: the digits run reads its data in memory and trains the same on
every run (±0.0005 on a 4-decimal figure); the Hugging Face fine-tunes stream their files
through Ray Data, whose blocks reach the ranks in an order that varies between runs (four runs
of train.yaml gave 5.03 to 5.21 at step 40), so their held-out losses hold to the ±0.15 the pages
state.

Slow (about 5 minutes on 2 cores: three runs on Ray and a tokenizer trained from scratch): run by
`make test-all` and on a fresh clone before a release; `make test` checks the commands'
blocks parse (tests/e2e/test_readme.py)."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, read_json

pytestmark = [pytest.mark.slow, pytest.mark.ray]

README = (REPO / "README.md").read_text()
HF_PAGE = (REPO / "docs" / "hf.md").read_text()


def quoted(text: str, pattern: str) -> list[float]:
    """The numbers `pattern`'s groups find in a page (which must still say it)."""
    found = re.search(pattern, text, re.S)
    assert found, f"the page no longer quotes {pattern!r}: update tests/e2e/test_doc_figures.py with it"
    return [float(g) for g in found.groups()]


def eval_losses(tracking_db: Path, run_id: str) -> dict[int, float]:
    """The run's held-out loss by step, from its MLflow run (what the MLflow UI plots)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tracking_db}")
    return {m.step: m.value for m in client.get_metric_history(run_id, "eval/loss")}


def finished(proc, timeout: float) -> None:
    rc = proc.wait(timeout=timeout)
    assert rc == 0, proc.output[-3000:]


def test_the_readme_digits_outcome_is_what_make_run_prints(run_cli, tmp_path):
    steps, epochs = quoted(README, r"steps:\s+(\d+) in (\d+) epochs on 2 workers")
    accuracy, loss = quoted(README, r"eval:\s+accuracy ([\d.]+) loss ([\d.]+)")
    proc = run_cli(
        "train",
        str(REPO / "pipelines" / "digits.yaml"),
        "--set",
        "scaling.num_workers=2",
        "--summary-json",
        str(tmp_path / "s.json"),
    )
    finished(proc, timeout=600)
    summary = read_json(tmp_path / "s.json")
    assert (summary["steps"], summary["epochs"]) == (steps, epochs)
    assert summary["metrics"]["accuracy"] == pytest.approx(accuracy, abs=5e-4)
    assert summary["metrics"]["loss"] == pytest.approx(loss, abs=5e-4)


def test_the_hf_example_losses_are_what_its_commands_give(run_cli, tmp_path):
    full_20, full_40, spread = quoted(README, r"held-out loss about ([\d.]+) at step 20, ([\d.]+) at 40 \(±([\d.]+)")
    hf_full, lora_20, hf_spread = quoted(
        HF_PAGE,
        r"held-out loss is about ([\d.]+) at step 40 and the LoRA run's about ([\d.]+) at step 20.*?within ±([\d.]+)",
    )
    assert (hf_full, hf_spread) == (full_40, spread), "README.md and docs/hf.md quote different figures for one run"

    example = tmp_path / "hf-finetune"
    shutil.copytree(REPO / "examples" / "hf-finetune", example)
    env = cli_env(tmp_path)
    db = tmp_path / "mlflow.db"
    make = run_cli("make_model.py", "tiny", launcher=[sys.executable], cwd=example, env=env)
    finished(make, timeout=300)

    full = run_cli("train", "train.yaml", "--summary-json", "full.json", cwd=example, env=env)
    finished(full, timeout=900)
    losses = eval_losses(db, read_json(example / "full.json")["run_id"])
    assert losses[20] == pytest.approx(full_20, abs=spread), losses
    assert losses[40] == pytest.approx(full_40, abs=spread), losses

    export = run_cli("export", "runs/full", "--format", "hf", "--out", "exported", cwd=example, env=env)
    finished(export, timeout=300)
    lora = run_cli("train", "lora.yaml", "--summary-json", "lora.json", cwd=example, env=env)
    finished(lora, timeout=900)
    losses = eval_losses(db, read_json(example / "lora.json")["run_id"])
    assert losses[20] == pytest.approx(lora_20, abs=spread), losses
    assert losses[40] < losses[20], losses
