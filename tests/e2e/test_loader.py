"""The map-style loader: the pipeline's collate_fn, worker processes and pinned memory from the
config's `loader` section, an exact resume with workers (random augmentations included), and a
collate_fn that raises, named in one line with and without workers."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from raylane.config import ConfigError, load_config
from tests.conftest import REPO, cli_env, read_json

HELPER = REPO / "tests" / "helpers" / "ragged.py"
QUIET = ["--set", "mlflow.enabled=false"]


def _project(tmp_path):
    shutil.copy(HELPER, tmp_path / "pipe.py")
    (tmp_path / "cfg.yaml").write_text(
        "pipeline: ./pipe.py\ntrain: {batch_size: 8, max_epochs: 2}\noptim: {lr: 0.05}\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import pipe
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("pipe", None)
    return pipe


def _weights(pipe, summary: dict) -> dict[str, torch.Tensor]:
    from raylane.loop import checkpoint

    model = pipe.Net(4)
    state = checkpoint.load(summary["checkpoint"], model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert state["step"] == summary["steps"]
    return model.state_dict()


def test_a_collate_fn_over_ragged_items_trains_with_workers_and_resumes_bit_exact(run_cli, tmp_path):
    """96 sequences of 1-7 values, padded by the pipeline's collate_fn, with noise drawn as each
    is read, loaded by 2 worker processes: 12 batches an epoch, 2 epochs. A run stopped in its
    2nd epoch (step 17) and relaunched ends with the weights and held-out loss of an
    uninterrupted run, bit for bit: each batch is loaded with generators seeded from its place,
    whichever worker loads it. Before, collate_fn and the loader section were ignored."""
    pipe = _project(tmp_path)
    (tmp_path / "marks").mkdir()
    env = cli_env(tmp_path, WORKER_MARKS=str(tmp_path / "marks"))
    args = ["train", "cfg.yaml", "--local", "--set", "loader.num_workers=2"]
    straight = run_cli(*args, *QUIET, "--set", "run.name=s", "--summary-json", "s.json", env=env, name="straight")
    first = run_cli(
        *args,
        *QUIET,
        "--set",
        "run.name=r",
        "--set",
        "train.max_steps=17",
        "--summary-json",
        "a.json",
        env=env,
        name="first",
    )
    assert first.wait(120) == 0, first.output
    again = run_cli(*args, *QUIET, "--set", "run.name=r", "--summary-json", "b.json", env=env, name="again")
    assert straight.wait(120) == 0, straight.output
    assert again.wait(120) == 0, again.output

    s, a, b = (read_json(tmp_path / f"{n}.json") for n in "sab")
    assert (s["status"], s["steps"], a["steps"], b["resumed_from_step"], b["steps"]) == ("FINISHED", 24, 17, 17, 24)
    assert len(list((tmp_path / "marks").iterdir())) >= 4  # 2 workers a run padded batches (and more for eval)
    w_straight, w_resumed = _weights(pipe, s), _weights(pipe, b)
    for name, tensor in w_straight.items():
        assert torch.equal(w_resumed[name], tensor), name
    assert b["metrics"]["loss"] == s["metrics"]["loss"]  # the held-out set's noise too


@pytest.mark.untracked
def test_a_collate_fn_that_raises_names_itself_and_its_line(run_cli, tmp_path):
    """In the rank's own process, and in a loader worker, whose exception torch re-raises with
    the worker's traceback as text: one line naming collate_fn and the pipeline's file:line."""
    _project(tmp_path)
    env = cli_env(tmp_path, COLLATE_RAISES="2")  # the 1st call is the example batch, before training
    runs = {
        w: run_cli(
            "train",
            "cfg.yaml",
            "--local",
            "--set",
            f"loader.num_workers={w}",
            "--set",
            f"run.name=w{w}",
            "--summary-json",
            f"w{w}.json",
            env=env,
            name=f"w{w}",
        )
        for w in (0, 2)
    }
    line = next(n for n, text in enumerate(HELPER.read_text().splitlines(), 1) if "raise ValueError" in text)
    expected = (
        f"pipeline {str(tmp_path / 'pipe.py')!r}: collate_fn(items) raised ValueError: a ragged batch of "
        f"8 items (at {tmp_path / 'pipe.py'}:{line})"
    )
    for w, proc in runs.items():
        assert proc.wait(120) == 1, proc.output
        assert read_json(tmp_path / f"w{w}.json")["error"] == expected, w
        assert [x for x in proc.output.splitlines() if "ragged batch" in x] == [f"  error:         {expected}"], w
        assert "Traceback" not in proc.output, w


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("loader.prefetch_factor=4", "loader.prefetch_factor = 4: needs loader.num_workers > 0"),
        ("loader.persistent_workers=true", "loader.persistent_workers = True: needs loader.num_workers > 0"),
        ("loader.pin_memory=true", "loader.pin_memory = True needs scaling.use_gpu: true"),
        ("loader.num_workers=many", "loader.num_workers = 'many': expected a number of workers from 0 to 256, or auto"),
        ("loader.num_workers=-1", "loader.num_workers = -1: expected"),
    ],
)
def test_loader_settings_that_cannot_work_are_refused_before_the_run(override, says):
    """torch itself raises only when the DataLoader is made, on every rank, after the workers
    and the MLflow run have started (prefetch_factor), or warns and pins nothing (pin_memory)."""
    with pytest.raises(ConfigError, match="^invalid config: ") as info:
        load_config("regression", [override])
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_cli_exits_2_on_a_loader_setting_without_workers(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "raylane", "check", "regression", "--set", "loader.prefetch_factor=2"],
        check=False,
        cwd=tmp_path,
        env=cli_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "loader.prefetch_factor = 2: needs loader.num_workers > 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_loader_options_follow_the_device_and_reach_the_dataloader(tmp_path):
    """Nulls and auto, chosen from the device: pinned memory and workers on a GPU only. The
    options and the collate_fn reach the train and held-out DataLoaders."""
    from raylane.loop.data.loader import build_loader, cores, eval_data, worker_options
    from raylane.loop.distributed.devices import local_world_size

    def options(device: str, *sets: str) -> dict:
        return worker_options(load_config("regression", list(sets)).loader, torch.device(device))

    assert options("cpu") == {"num_workers": 0, "pin_memory": False}
    assert options("cuda") == {"num_workers": 0, "pin_memory": True}
    assert options("cpu", "loader.num_workers=auto") == {"num_workers": 0, "pin_memory": False}
    auto = min(4, max(0, cores() // local_world_size() - 1))
    assert options("cuda", "loader.num_workers=auto")["num_workers"] == auto
    assert options("cuda", "loader.num_workers=2", "loader.prefetch_factor=3") == {
        "num_workers": 2,
        "pin_memory": True,
        "persistent_workers": True,
        "prefetch_factor": 3,
    }
    assert (
        options(
            "cuda",
            "loader.num_workers=2",
            "loader.persistent_workers=false",
            "loader.pin_memory=false",
            "scaling.use_gpu=true",
        )["persistent_workers"]
        is False
    )

    pipe = _project(tmp_path)
    chosen = {"num_workers": 2, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 3}
    train = build_loader(
        pipe.Sequences(10, 0),
        batch_size=4,
        rank=0,
        world_size=1,
        seed=0,
        shuffle=True,
        collate_fn=pipe.pad,
        options=chosen,
    )
    runtime = type("Runtime", (), {"rank": 0, "world_size": 1})()
    held = eval_data(pipe.Sequences(10, 0), runtime, batch_size=4, seed=0, collate_fn=pipe.pad, options=chosen)
    for loader in (train, held):
        assert (loader.num_workers, loader.pin_memory, loader.persistent_workers, loader.prefetch_factor) == (
            2,
            True,
            True,
            3,
        )
        assert loader.collate_fn is pipe.pad
    assert train.batches_in_epoch(0) == 3
