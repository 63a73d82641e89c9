"""A pipeline of the user's own, outside the package (examples/own-model, which has folders named
`app/` and `pipelines/` of its own), trained everywhere a shipped pipeline trains: on Ray workers
joining a token-authenticated head with `raylane train --address`, under torchrun and in a Tune
sweep. As a `ray job submit` job it runs in tests/e2e/test_cluster_e2e.py. Bad references exit 2 with
one line naming the pipeline; a failing build(cfg) fails the run (exit 1), one that refuses its
config (ConfigError) is bad input (exit 2)."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, TORCHRUN, cli_env, read_json
from tests.e2e.test_cluster_e2e import BIN, EXAMPLE, QUICK, _mlflow_run


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of the example project, away from raylane's checkout."""
    return Path(shutil.copytree(EXAMPLE, tmp_path / "own-model", ignore=shutil.ignore_patterns("__pycache__")))


def _finished(tmp_path: Path, summary: str) -> dict:
    s = read_json(tmp_path / summary)
    assert s["status"] == "FINISHED" and s["metrics"]["accuracy"] > 0.3, s
    status, tags = _mlflow_run(tmp_path / "mlflow.db", s["run_id"])
    assert status == "FINISHED"
    return {**s, "tags": tags}


# Slow (~16 s): make test runs this project on a head's Ray workers from its own folder as a `ray
# job submit` job (tests/e2e/test_cluster_e2e.py); the shared_ray tests join the head `raylane up`
# started (found through RAYLANE_HOME), and --address is resolved by the same code.
@pytest.mark.slow
def test_example_trains_on_two_ray_workers_from_its_own_directory(run_cli, project, tmp_path, shared_head):
    """The working directory holds the project's own app/ and pipelines/: raylane is unaffected.
    The run joins the session's token-authenticated head by `--address` alone, as a user joins a
    head on another machine (its own empty RAYLANE_HOME: no `raylane up` head to find), and the
    head's workers get the project with the run."""
    head = shared_head.cluster()
    token = {k: v for k, v in shared_head.start().items() if k.startswith("RAY_AUTH")}
    p = run_cli(
        "train",
        "train.yaml",
        "--address",
        head["address"],
        "--set",
        "scaling.num_workers=2",
        *QUICK,
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
        "--summary-json",
        str(tmp_path / "s.json"),
        cwd=project,
        env=cli_env(tmp_path, **token),
    )
    assert p.wait(300) == 0, p.output
    s = _finished(tmp_path, "s.json")
    assert s["world_size"] == 2 and s["run_name"].startswith("shapes-")
    assert s["tags"]["raylane.pipeline"] == str(project / "pipelines" / "shapes.py")
    # This process was a driver on that head (not on an embedded cluster of its own).
    assert list(Path(head["temp_dir"]).glob(f"session_latest/logs/python-core-driver-*_{p.proc.pid}.log")), p.output


@pytest.mark.parametrize(
    "config, module",
    [
        # shapes trains on Ray in make test; records covers torchrun and a dotted module here
        pytest.param("train.yaml", "pipelines.shapes", marks=pytest.mark.slow),
        ("train-records.yaml", "pipelines.records"),
    ],
)
def test_example_trains_under_torchrun_as_a_dotted_module(run_cli, project, tmp_path, config, module):
    """Both of the example's pipelines: `shapes` ((input, target) pairs and a loss_fn) and
    `records` (dict batches passed as model(**batch), the model's own loss, no loss_fn)."""
    records = module == "pipelines.records"
    p = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        "train",
        config,
        "--set",
        f"pipeline={module}",
        *QUICK,
        *(["--set", "mlflow.log_model=true"] if records else []),
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
        "--summary-json",
        str(tmp_path / "t.json"),
        launcher=TORCHRUN,
        cwd=project,
    )
    assert p.wait(180) == 0, p.output
    s = _finished(tmp_path, "t.json")
    assert s["world_size"] == 2 and s["tags"]["raylane.pipeline"] == module
    if records:  # the MLflow model, logged from the dict batch's inputs
        assert s["model_uri"].startswith("models:/"), s


@pytest.mark.shared_ray
@pytest.mark.slow  # ~45 s; the example on Ray and ASHA's stops are in make test on their own (test_tune's ASHA sweep)
def test_example_throughput_sweep_from_the_repo_root_stops_the_slow_trials_early(run_cli, project, tmp_path):
    """From raylane's checkout, whose app/ and pipelines/ folders come first on a Ray worker's
    sys.path (Ray puts the driver's working directory there): the project's own must win.
    `sweep.metric: samples_per_s` (mode max): each trial reports its epoch's
    throughput after warm-up, and ASHA stops trials whose small batches run slower."""
    p = run_cli(
        "tune",
        str(project / "sweep.yaml"),
        "--set",
        "scaling.num_workers=1",
        "--set",
        "sweep.max_concurrent_trials=2",
        "--set",
        "sweep.scheduler=asha",
        "--set",
        "sweep.metric=samples_per_s",
        "--set",
        "sweep.space={train.batch_size: {grid: [250, 4]}}",
        "--set",
        "sweep.num_samples=2",
        *QUICK,
        "--set",
        "train.max_epochs=2",
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
        "--summary-json",
        str(tmp_path / "sweep.json"),
        cwd=REPO,
    )
    assert p.wait(300) == 0, p.output
    s = read_json(tmp_path / "sweep.json")
    trials = s["trials"]
    assert [t["config"]["train.batch_size"] for t in trials] == [250, 4, 250, 4]
    slow = [t for t in trials if t["config"]["train.batch_size"] == 4]
    fast = [t for t in trials if t["config"]["train.batch_size"] == 250]
    assert any(t["early_stopped"] and t["metrics"]["epoch"] == 1 for t in slow), trials
    assert min(t["metrics"]["samples_per_s"] for t in fast) > max(t["metrics"]["samples_per_s"] for t in slow)
    assert s["best"]["config"]["train.batch_size"] == 250
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        statuses = sorted(status for (status,) in con.execute("SELECT status FROM runs"))
    # The parent, and each trial FINISHED or KILLED (stopped early): none left RUNNING or FAILED.
    assert len(statuses) == 5 and set(statuses) <= {"FINISHED", "KILLED"}, statuses
    assert statuses.count("KILLED") == sum(t["early_stopped"] for t in trials)


CONFIG = "pipeline: ./pipe.py\nmodel: {width: 4}\n"
GOOD_CONFIG = """
import raylane

class Model(raylane.Section):
    width: int = 4

class Config(raylane.BaseConfig):
    model: Model = Model()
"""
BAD = {
    "module missing": ("pipeline: no_such_pkg.pipes\n", None, "pipeline = 'no_such_pkg.pipes': unknown pipeline"),
    "file missing": ("pipeline: ./nowhere.py\n", None, "pipeline = './nowhere.py': no such file"),
    "misspelled": ("pipeline: digts\n", None, "did you mean 'digits'?"),
    "no build": (CONFIG, GOOD_CONFIG, "defines no build(cfg) function"),
    "no Config": (CONFIG, "def build(cfg):\n    pass\n", "defines no Config class"),
    "Config not BaseConfig": (
        CONFIG,
        "class Config:\n    pass\ndef build(cfg):\n    pass\n",
        "not a subclass of raylane.BaseConfig",
    ),
    "import error": (
        CONFIG,
        "import os\nimport no_such_module_xyz\n",
        "ModuleNotFoundError: No module named 'no_such_module_xyz' (at {pipe}:2)",
    ),
    "syntax error": (CONFIG, "import os\n\ndef build(cfg:\n", "SyntaxError: '(' was never closed (at {pipe}:3)"),
    "raises at import": (
        CONFIG,
        "x = 1\nraise RuntimeError('no GPU here')\n",
        "RuntimeError: no GPU here (at {pipe}:2)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_reference_exits_2_naming_the_pipeline(tmp_path, case):
    config, module, message = BAD[case]
    folder = tmp_path / "bad"  # not the working directory: references resolve from the config's
    folder.mkdir()
    (folder / "cfg.yaml").write_text(config)
    if module is not None:
        (folder / "pipe.py").write_text(module)
    out = subprocess.run(
        [str(BIN / "raylane"), "check", str(folder / "cfg.yaml")],
        cwd=tmp_path,
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert message.format(pipe=folder / "pipe.py") in lines[0] and "pipeline = " in lines[0], lines[0]


def test_train_tune_and_submit_reject_a_bad_pipeline_before_starting_anything(tmp_path):
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    (tmp_path / "pipe.py").write_text("import no_such_module_xyz\n")
    (tmp_path / "sweep.yaml").write_text("sweep: {name: s, base: cfg.yaml, space: {optim.lr: {grid: [0.1]}}}\n")
    for argv in (
        ["train", "cfg.yaml"],
        ["tune", "sweep.yaml"],
        ["submit", "cfg.yaml", "--address", "http://127.0.0.1:9"],
    ):
        out = subprocess.run(
            [str(BIN / "raylane"), *argv],
            cwd=tmp_path,
            env=cli_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (argv, out.stdout + out.stderr)
        assert f"pipeline = {str(tmp_path / 'pipe.py')!r}" in out.stderr and "no_such_module_xyz" in out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.untracked
def test_a_build_that_raises_fails_the_run_naming_the_pipeline(run_cli, tmp_path):
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    (tmp_path / "pipe.py").write_text(
        GOOD_CONFIG
        + textwrap.dedent("""
        def build(cfg):
            raise FileNotFoundError("no data in /nowhere")
    """)
    )
    p = run_cli("train", "cfg.yaml", "--local", *QUICK, "--set", f"run.storage_path={tmp_path / 'runs'}")
    assert p.wait(120) == 1, p.output
    assert (
        f"pipeline {str(tmp_path / 'pipe.py')!r}: build(cfg) raised FileNotFoundError: no data in /nowhere" in p.output
    ), p.output
    assert "Traceback" not in p.output


def test_a_build_that_refuses_its_config_exits_2_in_one_line_its_mlflow_run_failed(run_cli, tmp_path):
    """A ConfigError from build(cfg) (raylane.hf.pipeline refusing a data.mix source it has no
    dataset for) is bad input found on the rank: the line a config's own check would print, exit 2,
    no summary (as before the start), the MLflow run opened already closed FAILED with the line.
    Before: 'build(cfg) raised ConfigError: ... (at pipe.py:N)', exit 1."""
    from tests.helpers import config_error_pipe

    config_error_pipe.write_project(tmp_path)
    p = run_cli(
        "train", "cfg.yaml", "--local", *QUICK, "--set", f"run.storage_path={tmp_path / 'runs'}",
        "--summary-json", "s.json",
    )  # fmt: skip
    assert p.wait(120) == 2, p.output
    said = [line for line in p.output.splitlines() if config_error_pipe.MESSAGE in line]
    assert said == [config_error_pipe.LINE] and "Traceback" not in p.output, p.output
    assert not (tmp_path / "s.json").exists()
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        runs = con.execute(
            "SELECT status, value FROM runs LEFT JOIN tags USING (run_uuid) WHERE key = 'raylane.error'"
        ).fetchall()
        total = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
    assert total == 1 and runs == [("FAILED", config_error_pipe.LINE.removeprefix("raylane: "))], runs


NO_EXAMPLE = """
import torch
import raylane
from raylane.loop.protocols.pipeline import Pipeline


class Config(raylane.BaseConfig):
    def eval_metrics(self):
        return ("loss",)


def build(cfg):
    from torch.utils.data import TensorDataset
    x = torch.linspace(0, 1, 64)[:, None]
    return Pipeline(model=torch.nn.Linear(1, 1), train_set=TensorDataset(x, 2 * x), eval_set=TensorDataset(x, 2 * x),
                    loss_fn=torch.nn.functional.mse_loss,
                    eval_sums=lambda o, t: {"loss": torch.nn.functional.mse_loss(o, t, reduction="sum")})
"""


def test_a_pipeline_without_an_example_input_logs_its_model_from_its_first_eval_rows(run_cli, tmp_path, monkeypatch):
    """`example_input` is optional: the MLflow model's example and signature come from the eval
    set's first two inputs (before, the model was not logged: 'linear(): ... not NoneType')."""
    (tmp_path / "pipe.py").write_text(NO_EXAMPLE)
    (tmp_path / "cfg.yaml").write_text(
        "pipeline: ./pipe.py\ntrain: {max_epochs: 1, batch_size: 16}\nmlflow: {system_metrics: false}\n"
    )
    p = run_cli(
        "train", "cfg.yaml", "--local", "--set", f"run.storage_path={tmp_path / 'runs'}", "--summary-json", "s.json"
    )
    assert p.wait(180) == 0, p.output
    s = read_json(tmp_path / "s.json")
    assert s["model_uri"].startswith("models:/") and "could not record" not in p.output, p.output
    import mlflow.pyfunc
    import numpy as np

    monkeypatch.setenv("MLFLOW_TRACKING_URI", s["tracking_uri"])  # set_tracking_uri would outlive this test
    model = mlflow.pyfunc.load_model(s["model_uri"])
    assert model.metadata.get_input_schema().inputs[0].shape == (-1, 1)  # from 2 stacked (1,) rows
    assert np.asarray(model.predict(np.zeros((3, 1), dtype=np.float32))).shape == (3, 1)


def test_no_example_batch_from_inputs_that_do_not_stack_names_the_field():
    import torch

    from raylane.loop.protocols.pipeline import Pipeline, example_batch

    rows = [({"x": torch.zeros(1)}, torch.zeros(1))] * 4  # dict inputs: nothing to stack
    pipe = Pipeline(model=torch.nn.Linear(1, 1), train_set=rows, eval_set=None, loss_fn=None, eval_sums=None)
    with pytest.raises(ValueError, match="the pipeline sets no example_input"):
        example_batch(pipe)
    ragged = [(torch.zeros(n), torch.zeros(1)) for n in (1, 2)]
    pipe.eval_set = ragged  # tried first, then the train set
    with pytest.raises(ValueError, match="a batch of 2 rows or more"):
        example_batch(pipe)
    pipe.train_set = [(torch.ones(3), 0), (torch.zeros(3), 1)]
    assert torch.equal(example_batch(pipe), torch.stack([torch.ones(3), torch.zeros(3)]))
    pipe.example_input = torch.full((2, 3), 7.0)  # the pipeline's own wins
    assert example_batch(pipe) is pipe.example_input
