"""A run that fails on bad data or on an error in the user's own pipeline code says so in one
line naming the place: the file, row (or row group), column and value of bad data; the function,
the exception and the user's `file:line` for the user's code; the whole traceback is in the
library log. Bad data in the first rows of the first file is found by the check, exit 2;
what only the run reads fails it (exit 1): by pyarrow in one process, by Ray Data on Ray."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import TORCHRUN, read_json

TABULAR = [
    "--set",
    "data.features=[a, b]",
    "--set",
    "data.target=label",
    "--set",
    "data.num_classes=2",
    "--set",
    "train.batch_size=16",
    "--set",
    "train.max_epochs=1",
]


def _rows(n: int, seed: int) -> list[str]:
    x = np.random.default_rng(seed).normal(size=(n, 2))
    return [f"{a:.4f},{b:.4f},{int(a > 0)}" for a, b in x]


def _csv(path: Path, rows: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("a,b,label\n" + "\n".join(rows) + "\n")
    return path


def _with(rows: list[str], index: int, row: str) -> list[str]:
    return [*rows[:index], row, *rows[index + 1 :]]


def _parquet(path: Path, n: int = 400) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    x = np.random.default_rng(0).normal(size=(n, 2))
    pq.write_table(
        pa.table({"a": x[:, 0], "b": x[:, 1], "label": (x[:, 0] > 0).astype(np.int64)}), path, row_group_size=100
    )
    return path


def _corrupt_row_group(path: Path, group: int) -> None:
    """Zeros over the start of one row group's column data: its page header cannot be read."""
    data = bytearray(path.read_bytes())
    offset = pq.read_metadata(path).row_group(group).column(1).data_page_offset
    data[offset : offset + 40] = bytes(40)
    path.write_bytes(bytes(data))


def _error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip().startswith("error:") or line.startswith("raylane:")]
    assert len(lines) == 1, output
    assert "Traceback" not in output and "\x1b[" not in output, output
    return lines[0]


def _library_log(output: str) -> str:
    found = re.search(r"library log:\s+(\S+\.log)", output)
    assert found, output
    return Path(found.group(1)).read_text()


# -- bad data -----------------------------------------------------------------------------------


def _bad_first_files(tmp: Path) -> dict[str, tuple[Path, str, str]]:
    """case -> (file, format, the line's expected text: file, row, column, value)."""
    good = _rows(40, 1)
    truncated = _parquet(tmp / "truncated.parquet")
    truncated.write_bytes(truncated.read_bytes()[:2000])
    corrupt = _parquet(tmp / "corrupt.parquet")
    _corrupt_row_group(corrupt, 0)
    return {
        "null": (
            _csv(tmp / "null.csv", _with(good, 16, "0.5,n/a,1")),
            "csv",
            f"data.features: {tmp / 'null.csv'} row 17, column 'b' has no value ('n/a')",
        ),
        "not a number": (
            _csv(tmp / "text.csv", _with(good, 16, "0.5,abc,1")),
            "csv",
            f"data.features: {tmp / 'text.csv'} row 17, column 'b' has 'abc'; expected a number",
        ),
        "class id out of range": (
            _csv(tmp / "label.csv", _with(good, 16, "0.5,0.3,5")),
            "csv",
            f"data.num_classes = 2: {tmp / 'label.csv'} row 17, column 'label' has 5",
        ),
        "truncated parquet": (
            truncated,
            "parquet",
            f"data.train: {truncated}: not a readable Parquet file (ArrowInvalid: Parquet magic",
        ),
        "corrupt parquet": (corrupt, "parquet", f"data.train: {corrupt}: cannot be read (OSError: "),
    }


def test_bad_data_in_the_first_rows_exits_2_naming_its_file_row_column_and_value(run_cli, tmp_path):
    # `raylane check` forked from the tests' zygote: the same command without an interpreter's imports each.
    for case, (path, fmt, expected) in _bad_first_files(tmp_path / "data").items():
        p = run_cli("check", "tabular", "--set", f"data.train={path}", "--set", f"data.format={fmt}", *TABULAR)
        assert p.wait(120) == 2, (case, p.output)
        line = _error_line(p.output)
        assert line.startswith("raylane: invalid config: ") and expected in line, (case, line)


@pytest.mark.untracked
def test_bad_data_found_while_training_in_one_process_is_one_line_with_its_place(run_cli, tmp_path):
    """Past what the check reads (a second file, a later CSV block, a later row group), each
    rank's pyarrow reader names the place; a null cell no longer trains as a NaN loss."""
    cases = {
        "null": (
            _csv(tmp_path / "null" / "b.csv", _with(_rows(100, 2), 41, "0.5,n/a,1")),
            "csv",
            (
                f"data.features: {tmp_path / 'null' / 'b.csv'} row 42, column 'b' has no value ('n/a'); "
                "fill or drop such rows"
            ),
        ),
        # pyarrow reads a CSV in 1 MB blocks and types a column from the first: its error names no row.
        "text past the first block": (
            _csv(tmp_path / "big" / "a.csv", _with(_rows(100_000, 3), 90_000, "0.5,abc,1")),
            "csv",
            (
                f"data.train: {tmp_path / 'big' / 'a.csv'} row 90001, column 'b' "
                "has 'abc'; expected a number, as in the rows before it"
            ),
        ),
        "corrupt row group": (
            _parquet(tmp_path / "pq" / "b.parquet"),
            "parquet",
            f"data.train: {tmp_path / 'pq' / 'b.parquet'} row group 2 (rows 201-300): cannot be read",
        ),
    }
    _csv(tmp_path / "null" / "a.csv", _rows(100, 1))
    _parquet(tmp_path / "pq" / "a.parquet")
    _corrupt_row_group(tmp_path / "pq" / "b.parquet", 2)
    for case, (path, fmt, expected) in cases.items():
        p = run_cli(
            "train",
            "tabular",
            "--local",
            "--set",
            f"data.train={path.parent}",
            "--set",
            f"data.format={fmt}",
            *TABULAR,
            "--set",
            f"run.storage_path={tmp_path / 'runs'}",
            name=case.replace(" ", "-"),
        )
        assert p.wait(180) == 1, (case, p.output)
        line = _error_line(p.output)
        assert expected in line, (case, line)
        assert "non-finite loss" not in p.output
        assert "Traceback" in _library_log(p.output)


@pytest.mark.slow  # Ray Data beside the workers (~36 s); the same one line for bad rows stays in make test in one process
@pytest.mark.shared_ray
@pytest.mark.untracked
def test_bad_data_read_by_ray_data_is_one_line_with_its_place(run_cli, tmp_path):
    """Ray Data's task error (text in colour, wrapped, once per rank: 51 lines before) is found
    again with pyarrow: one line naming the file, row, column and value, and the key it breaks."""
    folder = tmp_path / "data"
    _csv(folder / "a.csv", _rows(100, 1))
    _csv(folder / "b.csv", _with(_rows(100, 2), 41, "0.5,0.3,5"))
    p = run_cli(
        "train",
        "tabular",
        "--set",
        f"data.train={folder}",
        "--set",
        "data.format=csv",
        *TABULAR,
        "--set",
        "scaling.num_workers=2",
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
    )
    assert p.wait(300) == 1, p.output
    line = _error_line(p.output)
    assert re.search(
        r"training failed on ranks? [0-9, ]+: data.num_classes = 2: "
        + re.escape(f"{folder / 'b.csv'} row 42, column 'label' has 5; class ids are whole numbers 0..1"),
        line,
    ), line
    log = _library_log(p.output)
    assert "Traceback" in log and "raise DataError" in log


def test_a_row_without_its_text_fails_a_fine_tune_in_one_line_or_is_skipped_and_counted(run_cli, tmp_path):
    """A JSON Lines row without its text (once trained as the word 'None', FINISHED) fails a
    --local fine-tune: one line naming the file, row and column, exit 1, the MLflow run FAILED.
    With data.skip_bad_rows the run finishes without it, and the summary and the terminal count
    it (the readers, the counting and the bound are proved in-process: tests/unit/test_bad_rows.py)."""
    import json
    import sqlite3

    from tests.helpers.hf_lm import make_base

    make_base(tmp_path / "model")
    rows = [{"text": f"w{3 + i % 90} w{4 + i % 80} w5 w6"} for i in range(40)]
    rows[20] = {"body": "w7 w8"}
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "cfg.yaml").write_text(
        f"pipeline: hf\nmodel: {{name_or_path: {tmp_path / 'model'}, seq_len: 8}}\ndata: {{train: {data}}}\n"
        "train: {max_steps: 2, batch_size: 4}\nmlflow: {log_model: false}\n"
    )
    said = f"data.text_column: {data} row 21, column 'text' has no value; each row needs its text"
    p = run_cli("train", "cfg.yaml", "--local", "--summary-json", "bad.json", name="bad")
    assert p.wait(240) == 1, p.output
    assert _error_line(p.output) == f"  error:         {said} (data.skip_bad_rows: true skips such rows)"
    summary = read_json(tmp_path / "bad.json")
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        (status,) = con.execute("SELECT status FROM runs WHERE run_uuid = ?", (summary["run_id"],)).fetchone()
    assert status == "FAILED" and summary["status"] == "FAILED"
    skipping = ["--set", "data.skip_bad_rows=true", "--set", "run.name=skip", "--set", "mlflow.enabled=false"]
    p = run_cli("train", "cfg.yaml", "--local", "--summary-json", "skip.json", *skipping, name="skip")
    assert p.wait(240) == 0, p.output
    summary = read_json(tmp_path / "skip.json")
    assert summary["skipped_rows"] == {"data.train": {"rows": 40, "skipped": 1, "first": said, "counts": {}}}
    assert summary["steps"] == 2
    assert f"  skipped rows:  data.train 1 of 40; the first: {said}" in p.output.splitlines()


@pytest.mark.slow  # Ray Data beside 2 workers: 5 min on 2 busy cores; make test proves the tally in-process (test_bad_rows.py)
@pytest.mark.shared_ray
@pytest.mark.untracked
def test_skipped_rows_on_ray_are_counted_once_by_the_drivers_counting_pass(run_cli, tmp_path):
    """On Ray, Ray Data's tasks drop the bad rows; the driver's counting pass tallies them once,
    before the workers start, and finds the first one's file and row again with pyarrow."""
    import json

    from tests.helpers.hf_lm import make_base

    make_base(tmp_path / "model")
    for part in range(2):
        rows = [{"text": f"w{3 + i % 90} w{4 + i % 80} w5", "label": i % 2} for i in range(40)]
        rows[5 + part] = {"body": "w7 w8", "label": 0}
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / f"p{part}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "cfg.yaml").write_text(
        f"pipeline: hf\nmodel: {{name_or_path: {tmp_path / 'model'}, seq_len: 8, task: sequence-classification}}\n"
        f"data: {{train: {tmp_path / 'data'}, skip_bad_rows: true}}\nscaling: {{num_workers: 2}}\n"
        "train: {max_steps: 2, batch_size: 4}\n"
    )
    p = run_cli("train", "cfg.yaml", "--summary-json", "s.json")
    assert p.wait(540) == 0, p.output
    first = (
        f"data.text_column: {tmp_path / 'data' / 'p0.jsonl'} row 6, column 'text' has no value; each row needs its text"
    )
    assert read_json(tmp_path / "s.json")["skipped_rows"] == {
        "data.train": {"rows": 80, "skipped": 2, "first": first, "counts": {}}
    }


# -- the user's code ------------------------------------------------------------------------

PIPELINE = """
import torch
import raylane
from torch.utils.data import TensorDataset


class Model(raylane.Section):
    mode: str = "ok"


class Config(raylane.BaseConfig):
    model: Model = Model()


class Net(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode, self.lin, self.spare = mode, torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

    def forward(self, x):
        if self.mode == "forward raises":
            return self.helper(x)
        if self.mode == "unused":
            return self.lin(x)
        return self.lin(x) + 0 * self.spare(x)

    def helper(self, x):
        raise RuntimeError("my layer got the wrong shape")


def build(cfg):
    x = torch.linspace(0, 1, 64)[:, None]
    data = TensorDataset(x, 2 * x)
    if cfg.model.mode == "dict":
        return {"model": Net(cfg.model.mode), "train_set": data}
    if cfg.model.mode == "float sums":
        sums = lambda output, target: {"loss": float(torch.nn.functional.mse_loss(output, target, reduction="sum"))}
    else:
        sums = lambda output, target: {"loss": torch.nn.functional.mse_loss(output, target, reduction="sum")}
    return raylane.Pipeline(model=Net(cfg.model.mode), train_set=data, eval_set=data,
                            loss_fn=torch.nn.functional.mse_loss, eval_sums=sums)
"""


def _line_of(pipe: Path, text: str) -> int:
    return next(i for i, line in enumerate(pipe.read_text().splitlines(), 1) if text in line)


def _own_pipeline(tmp_path: Path) -> Path:
    pipe = tmp_path / "mypipe.py"
    pipe.write_text(PIPELINE)
    (tmp_path / "cfg.yaml").write_text("pipeline: ./mypipe.py\ntrain: {max_epochs: 1, batch_size: 16}\n")
    return pipe


@pytest.mark.untracked
def test_an_error_in_the_users_code_is_one_line_naming_the_function_and_its_line(run_cli, tmp_path):
    pipe = _own_pipeline(tmp_path)
    float_sums = _line_of(pipe, "float(torch.nn.functional.mse_loss")
    cases = {
        "dict": f"pipeline {str(pipe)!r}: build(cfg) returned dict, not raylane.Pipeline "
        f"(at {pipe}:{_line_of(pipe, 'def build(cfg)')})",
        "float sums": f"pipeline {str(pipe)!r}: eval_sums(output, target) returned {{'loss': float}}: it must return "
        f"tensors (sums over the batch) (at {pipe}:{float_sums})",
        "forward raises": f"pipeline {str(pipe)!r}: the model's forward raised RuntimeError: my layer got the wrong "
        f"shape (at {pipe}:{_line_of(pipe, 'raise RuntimeError')})",
    }
    for mode, expected in cases.items():
        p = run_cli(
            "train",
            "cfg.yaml",
            "--local",
            "--set",
            f"model.mode={mode}",
            "--set",
            f"run.storage_path={tmp_path / 'runs'}",
            name=mode.replace(" ", "-"),
        )
        assert p.wait(180) == 1, (mode, p.output)
        line = _error_line(p.output)
        assert line.strip() == f"error:         {expected}", (mode, line)
        log = _library_log(p.output)
        assert "Traceback" in log and str(pipe) in log, (mode, log)


@pytest.mark.shared_ray
@pytest.mark.untracked
def test_an_error_in_the_users_code_on_ray_is_one_line_with_the_workers_traceback_in_the_log(run_cli, tmp_path):
    pipe = _own_pipeline(tmp_path)
    p = run_cli(
        "train",
        "cfg.yaml",
        "--set",
        "model.mode=forward raises",
        "--set",
        "scaling.num_workers=1",
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
    )
    assert p.wait(300) == 1, p.output
    line = _error_line(p.output)
    assert line.strip() == (
        f"error:         training failed on rank 0: pipeline {str(pipe)!r}: the model's forward "
        f"raised RuntimeError: my layer got the wrong shape (at {pipe}:"
        f"{_line_of(pipe, 'raise RuntimeError')})"
    ), line
    log = _library_log(p.output)  # the worker's whole traceback, on the driver
    assert f'File "{pipe}", line {_line_of(pipe, "raise RuntimeError")}, in helper' in log, log


# Slow (~19 s on the shared head): make test proves the Ray door's mapping in-process
# (tests/unit/test_fault_nodes.py: a group whose ranks refused their config fails as that
# ConfigError, through pickle) and the one line and exit 2 under --local (test_own_pipeline).
@pytest.mark.slow
@pytest.mark.shared_ray
@pytest.mark.untracked  # the MLflow run's close is the driver's, whatever the launch: test_own_pipeline's --local run
def test_a_build_refusing_its_config_on_a_ray_worker_is_one_line_and_exit_2(run_cli, tmp_path, shared_head):
    """A ConfigError from build(cfg) on a worker (tests/helpers/config_error_pipe.py) crosses Ray
    as itself: the driver says it as a config's own check and exits 2; the worker's traceback is in
    the library log. Before: 'training failed on rank 0: pipeline ...: build(cfg) raised
    ConfigError: ...', exit 1. Which ranks' ConfigErrors make it: tests/unit/test_fault_nodes.py."""
    from tests.helpers import config_error_pipe

    config_error_pipe.write_project(tmp_path)
    p = run_cli("train", "cfg.yaml", "--set", "scaling.num_workers=1", "--set", f"run.storage_path={tmp_path / 'runs'}")
    assert p.wait(300) == 2, p.output
    assert _error_line(p.output) == config_error_pipe.LINE
    # No outcome block names the library log (none does for bad input): it is the driver's, by its pid.
    [log] = (Path(shared_head.start()["RAYLANE_HOME"]) / "logs").glob(f"train-*-{p.proc.pid}.log")
    text = log.read_text()
    assert "training failed on rank 0:" in text and f'File "{tmp_path / "pipe.py"}", line' in text, text


@pytest.mark.untracked
def test_unused_parameters_under_ddp_name_raylanes_key_and_the_parameters(run_cli, tmp_path):
    _own_pipeline(tmp_path)
    p = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        "train",
        "cfg.yaml",
        "--set",
        "model.mode=unused",
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
        "--set",
        "mlflow.enabled=false",
        launcher=TORCHRUN,
    )
    assert p.wait(240) != 0, p.output
    # Both ranks raise it: rank 0's own line, or rank 1's (`training failed on rank 1: ...`) when
    # torchrun's SIGTERM reached rank 0 first (raylane.loop.observe.rankfailures).
    assert (
        "strategy.find_unused_parameters = false: the model's spare.weight, spare.bias got no "
        "gradient at a step on rank "
    ) in p.output, p.output
    assert "set strategy.find_unused_parameters: true" in p.output


@pytest.mark.untracked
def test_a_training_set_smaller_than_one_step_is_said_before_the_first_step(run_cli, tmp_path):
    _own_pipeline(tmp_path)
    p = run_cli(
        "train",
        "cfg.yaml",
        "--local",
        "--set",
        "train.batch_size=100",
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
    )
    assert p.wait(180) == 0, p.output
    lines = p.output.splitlines()
    said = [
        i
        for i, line in enumerate(lines)
        if line
        == (
            "the training set has 64 samples, fewer than one step's 100 (train.batch_size 100 x 1 worker): "
            "each epoch is one partial step"
        )
    ]
    first_step = next(i for i, line in enumerate(lines) if "step 1/1" in line)
    assert said and said[0] < first_step, p.output
