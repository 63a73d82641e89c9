"""Under torchrun a rank's failure is said as on Ray: rank 0, which closes the MLflow run and
writes the summary, names the first error by time (another rank's, read from torchrun's store:
raylane.loop.observe.rankfailures), not its own echo of it ("Connection closed by peer") nor torchrun's
SIGTERM, which once read `raylane: interrupted` and left the run KILLED. The run ends FAILED with
that line as its MLflow tag, its summary written, and the failed rank's log named. The choice of
the line, the store's records and the SIGTERM guard are proved in-process:
tests/unit/test_rank_failures.py."""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import REPO, TORCHRUN, cli_env, read_json

# Two blocks split over two stages (pp_stages="auto"): the second, on rank 1 (the last stage),
# raises at its fifth call, the third step's first micro-batch (1F1B, two micro-batches a step).
PIPELINE = """
import torch
import raylane
from torch.utils.data import TensorDataset


class Config(raylane.BaseConfig):
    pass


class Block(torch.nn.Module):
    def __init__(self, last):
        super().__init__()
        self.lin, self.last, self.calls = torch.nn.Linear(8, 8), last, 0

    def forward(self, h):
        self.calls += 1
        if self.last and self.calls > 4:
            raise ValueError("the last stage got a hidden state it cannot take")
        return torch.relu(self.lin(h))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([Block(False), Block(True)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(cfg):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    return raylane.Pipeline(model=Net(), train_set=TensorDataset(x, x.sum(1, keepdim=True)), eval_set=None,
                            loss_fn=torch.nn.functional.mse_loss, pp_stages="auto")
"""
NAN = "FloatingPointError: non-finite loss or gradients at step 3 (train.on_nan: stop)"


def _tracked(tmp_path: Path, run_id: str) -> tuple[str, str | None]:
    """The MLflow run's status and its raylane.error tag, from the test's database."""
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        [(status,)] = con.execute("SELECT status FROM runs WHERE run_uuid = ?", (run_id,)).fetchall()
        tag = con.execute("SELECT value FROM tags WHERE run_uuid = ? AND key = 'raylane.error'", (run_id,)).fetchall()
    return status, tag[0][0] if tag else None


def _ended_failed(p, tmp_path: Path, summary: str) -> dict:
    """The checks every such run passes: exit 1, one error line and no interrupt, the summary and
    the MLflow run FAILED with the line as its tag."""
    assert p.wait(300) == 1, p.output
    assert "raylane: interrupted" not in p.output and "checkpointing at the next step" not in p.output, p.output
    s = read_json(tmp_path / summary)
    assert s["status"] == "FAILED" and s["world_size"] == 2, s
    assert [line for line in p.output.splitlines() if line.startswith("  error:")] == [f"  error:         {s['error']}"]
    assert _tracked(tmp_path, s["run_id"]) == ("FAILED", s["error"])
    return s


def test_an_error_on_the_last_pipeline_stage_is_rank_1s_one_line(run_cli, tmp_path):
    pipe = tmp_path / "pipe.py"
    pipe.write_text(PIPELINE)
    (tmp_path / "cfg.yaml").write_text(
        "pipeline: ./pipe.py\ntrain: {max_epochs: 2, batch_size: 8}\nstrategy: {pp: 2}\n"
    )
    p = run_cli(
        "--nproc_per_node", "2", "-m", "raylane", "train", "cfg.yaml", "--summary-json", "s.json", launcher=TORCHRUN
    )  # fmt: skip
    s = _ended_failed(p, tmp_path, "s.json")
    line = next(i for i, text in enumerate(PIPELINE.splitlines(), 1) if "raise ValueError" in text)
    assert s["error"] == (
        f"training failed on rank 1: pipeline {str(pipe)!r}: the model's forward raised ValueError: the last stage "
        f"got a hidden state it cannot take (at {pipe}:{line})"
    ), s["error"]
    # Rank 1's own log, named under the block, holds its traceback; rank 0's library log too.
    [rank_log] = re.findall(r"^  rank 1 log:    (\S+)$", p.output, re.MULTILINE)
    assert f'File "{pipe}", line {line}, in forward' in Path(rank_log).read_text()
    [own_log] = re.findall(r"^  library log:   (\S+) ", p.output, re.MULTILINE)
    assert "training failed on rank 1" in Path(own_log).read_text() and own_log != rank_log


# Slow (~7 s, 5 of them rank 1's wait for rank 0 to say the line: raylane.cli._config_error): make
# test has rank 0 alone saying a ConfigError and every rank exiting 2 (test_bad_input_under_torchrun),
# and the driver's close of a run whose build refused its config (test_own_pipeline, --local).
@pytest.mark.slow
def test_a_build_refusing_its_config_on_every_rank_is_one_line_and_exit_2(run_cli, tmp_path):
    """Bad input only build(cfg) can tell (tests/helpers/config_error_pipe.py), raised on both
    ranks after the process group and the MLflow run started: rank 0 says it as a config's own
    check, every rank exits 2 (torchrun itself exits 1 and names them, as for any bad input:
    tests/e2e/test_bad_input.py), the MLflow run FAILED with the line. Before: FAILED, exit 1,
    'build(cfg) raised ConfigError: ... (at pipe.py:N)'."""
    from tests.helpers import config_error_pipe

    config_error_pipe.write_project(tmp_path)
    p = run_cli("--nproc_per_node", "2", "-m", "raylane", "train", "cfg.yaml", launcher=TORCHRUN)
    assert p.wait(300) != 0, p.output
    assert [line for line in p.output.splitlines() if line.startswith("raylane: ")] == [config_error_pipe.LINE]
    assert p.output.count("exitcode  : 2") == 2 and "ConfigError" not in p.output, p.output
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        [(run_id,)] = con.execute("SELECT run_uuid FROM runs").fetchall()
    assert _tracked(tmp_path, run_id) == ("FAILED", config_error_pipe.LINE.removeprefix("raylane: "))


def _all_ranks_nan(run_cli, tmp_path: Path, name: str):
    """2 DDP ranks whose step 3 is NaN on both: each raises at once (train.on_nan: stop), and
    torchrun SIGTERMs rank 0 as soon as rank 1 exits. Rank 0's health watch takes 3 s more to stop
    (injected: tests/helpers/delays), so the signal comes while rank 0 closes the run, as it did
    in 5 of the report's 11 runs under load: before, `raylane: interrupted`, no summary, KILLED."""
    env = cli_env(
        tmp_path,
        RAYLANE_FAULTS="nan@step=3",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "tests/helpers/delays"), os.environ.get("PYTHONPATH")])),
        RAYLANE_TEST_DELAYS="call:raylane.tracking.health:stop_watch=3@rank=0",
    )
    return run_cli(
        "--nproc_per_node", "2", "-m", "raylane", "train", "regression", "--set", f"run.name={name}",
        "--summary-json", f"{name}.json", env=env, launcher=TORCHRUN, name=name, fresh=True,
    )  # fmt: skip


def test_every_rank_failing_at_once_ends_failed_with_the_step_named(run_cli, tmp_path):
    s = _ended_failed(_all_ranks_nan(run_cli, tmp_path, "nan"), tmp_path, "nan.json")
    # Rank 0's own error, or rank 1's when the signal came before rank 0 raised: the same step.
    assert s["error"] in (NAN, f"training failed on rank 1: {NAN}"), s["error"]


@pytest.mark.slow  # 20 launches (~20 min on 2 busy cores); make test has the one above
@pytest.mark.timeout(3600)
def test_every_rank_failing_at_once_ends_failed_every_time(run_cli, tmp_path):
    for i in range(20):
        s = _ended_failed(_all_ranks_nan(run_cli, tmp_path, f"nan{i}"), tmp_path, f"nan{i}.json")
        assert s["error"] in (NAN, f"training failed on rank 1: {NAN}"), (i, s["error"])
