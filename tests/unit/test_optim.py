"""raylane's optimizer and schedule, and a pipeline's own: which parameters get weight decay, each
schedule's curve, and a run stopped part-way and resumed that ends exactly where an uninterrupted
one does (in this process with the real Trainer, and on 2 FSDP ranks under torchrun)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from raylane.config import load_config
from raylane.loop import checkpoint
from raylane.loop.checkpoint.storage import CheckpointStore, filesystem_for
from raylane.loop.observe import faults
from raylane.loop.optim import build_optimizer, build_scheduler, lr_factor, param_groups, schedule_note
from raylane.loop.protocols.runtime import LocalRuntime
from raylane.loop.run import run_worker
from raylane.pipelines_ref import UserCodeError
from tests.conftest import REPO

HELPER = REPO / "tests" / "helpers" / "optim_pipe.py"
STEPS = 16  # 64 rows, 8 a step, 2 epochs
SCHEDULES = {
    "constant": ["optim.warmup_steps=3"],
    "cosine": ["optim.warmup_steps=3", "optim.min_lr_ratio=0.1"],
    # A warmup of 11 steps: the cut's checkpoint (step 10) lands in it, and the resume finishes it.
    "linear": ["optim.warmup_steps=11"],
    "wsd": ["optim.warmup_steps=3", "optim.decay_fraction=0.25"],
}


@pytest.fixture
def pipe_file(tmp_path) -> Path:
    shutil.copy(HELPER, tmp_path / "pipe.py")
    return tmp_path / "pipe.py"


def _cfg(pipe_file: Path, *overrides: str):
    raw = {
        "pipeline": str(pipe_file),
        "run": {"storage_path": str(pipe_file.parent / "runs")},
        "train": {"batch_size": 8, "max_epochs": 2},
        "mlflow": {"log_every_n_steps": 1},
        "optim": {"name": "adamw", "lr": 0.05, "weight_decay": 0.1},
    }
    return load_config(raw, overrides)


class _Recorder:
    """Rank 0's metric logger, kept in memory: what MLflow would get (the lr at every step)."""

    def __init__(self) -> None:
        self.ready, self.lr = threading.Event(), {}
        self.ready.set()

    def log(self, metrics: dict[str, float], step: int) -> None:
        if "train/lr" in metrics:
            self.lr[step] = metrics["train/lr"]

    def close(self) -> None:
        pass

    def cost(self) -> float:
        return 0.0


def _train(cfg, name: str) -> tuple[dict, dict[int, float]]:
    """One launch of run `name` in this process (resuming its newest checkpoint, if any)."""
    fs, root = filesystem_for(cfg.run.storage_path)
    runtime = LocalRuntime(CheckpointStore(f"{root}/{name}", fs, 0), 0, 0, 1, torch.device("cpu"))
    recorder = _Recorder()
    try:
        return run_worker(cfg, runtime, recorder), recorder.lr
    except faults.InjectedFault:
        return {}, recorder.lr


def _state(path: str) -> dict:
    """A replicated checkpoint's state, its optimizer's grouped back from the flat form."""
    state = torch.load(Path(path) / checkpoint.STATE_FILE, map_location="cpu", weights_only=True)
    return {**state, "optim": checkpoint.state.grouped(state["optim"])}


def _net():
    import importlib.util

    spec = importlib.util.spec_from_file_location("optim_pipe", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net()


def _names(model: torch.nn.Module, groups: list[dict]) -> list[set[str]]:
    named = {id(p): n for n, p in model.named_parameters()}
    return [{named[id(p)] for p in g["params"]} for g in groups]


def test_no_weight_decay_on_biases_and_norms_each_parameter_once():
    """Linear + LayerNorm + an embedding tied to the output layer: decay on the 2-D weights
    (the tied one once), none on the bias and the norm's scale and shift; the switch, or no
    decay at all, gives one group (as before, so that older checkpoints still load)."""
    model = _net()
    groups = param_groups(model, 0.1)
    assert _names(model, groups) == [{"emb.weight", "blocks.0.weight"}, {"blocks.0.bias", "norm.weight", "norm.bias"}]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters())) == 5

    class ScaleNorm(torch.nn.Module):  # a model's own norm, with a 2-D parameter
        def __init__(self) -> None:
            super().__init__()
            self.g = torch.nn.Parameter(torch.ones(2, 2))

    odd = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), ScaleNorm())
    assert _names(odd, param_groups(odd, 0.1)) == [{"0.weight"}, {"1.g"}]
    no_bias = torch.nn.Linear(2, 2, bias=False)  # nothing without decay: no empty group
    assert len(param_groups(no_bias, 0.1)) == 1
    for groups in (param_groups(model, 0.1, decay_norm_and_bias=True), param_groups(model, 0.0)):
        assert len(groups) == 1 and len(groups[0]["params"]) == 5


def test_raylane_optimizer_groups_and_fused_adam(pipe_file):
    model = _net()
    adamw = build_optimizer(model, _cfg(pipe_file))
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.1, 0.0]
    assert all(g["fused"] for g in adamw.param_groups)  # this CPU has the fused kernel
    sgd = build_optimizer(model, _cfg(pipe_file, "optim.name=sgd", "optim.momentum=0.9"))
    assert [(g["weight_decay"], g["momentum"]) for g in sgd.param_groups] == [(0.1, 0.9), (0.0, 0.9)]


def test_each_schedule_curve():
    """Warmup 4 of 20 steps; the value at step s is the lr of step s + 1 (20: after the last)."""
    cfg = load_config("regression", ["optim.warmup_steps=4", "optim.min_lr_ratio=0.1"])

    def at(schedule: str, *steps: int, total: int = 20, **more) -> list[float]:
        o = cfg.optim.model_copy(update={"schedule": schedule, **more})
        return [round(lr_factor(s, o, total), 6) for s in steps]

    assert at("constant", 0, 3, 4, 19, 20) == [0.25, 1.0, 1.0, 1.0, 1.0]
    assert at("cosine", 0, 4, 12, 20, 30) == [0.25, 1.0, 0.55, 0.1, 0.1]
    assert at("linear", 4, 8, 12, 20) == [1.0, 0.775, 0.55, 0.1]
    # wsd: the last 25% (5 steps) decay linearly: held up to step 15.
    assert at("wsd", 2, 4, 14, 15, 17, 20, decay_fraction=0.25) == [0.75, 1.0, 1.0, 1.0, 0.64, 0.1]
    # A run too short for the warmup and the decay: the decay starts when the warmup ends.
    assert at("wsd", 3, 4, 5, 6, total=6, decay_fraction=0.5, min_lr_ratio=0.0) == [1.0, 1.0, 0.5, 0.0]
    short = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"schedule": "wsd", "decay_fraction": 0.5})})
    assert "the decay starts when the warmup ends and lasts 2 steps" in schedule_note(short, 6)
    assert schedule_note(short, 40) is None


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_every_schedule_ends_where_a_resume_moves_the_last_step(schedule):
    """Trainer.load_state_dict moves the last step of raylane's schedules (a resume whose steps
    per epoch changed): each still ends at lr x min_lr_ratio there."""
    cfg = load_config("regression", [f"optim.schedule={schedule}", "optim.warmup_steps=2", "optim.min_lr_ratio=0.2"])
    scheduler = build_scheduler(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0), cfg, total_steps=100)
    factor = scheduler.lr_lambdas[0]
    assert factor(50) > 0.2 and factor(100) == pytest.approx(0.2)
    scheduler.set_total_steps(60)
    assert factor(60) == pytest.approx(0.2) and factor(50) > 0.2


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_run_stopped_and_resumed_matches_an_uninterrupted_one(pipe_file, monkeypatch, schedule):
    """AdamW with weight decay in two groups, each schedule, 16 steps: a launch that fails at
    step 12 (its newest checkpoint: step 10) and a second launch that resumes it log the same lr
    at every step as an uninterrupted run, and end with the same weights and optimizer state,
    bit for bit, its parameter groups included."""
    cfg = _cfg(
        pipe_file,
        f"optim.schedule={schedule}",
        "checkpoint.every_n_steps=5",
        "checkpoint.keep=null",
        *SCHEDULES[schedule],
    )
    straight, lr_straight = _train(cfg, "straight")
    monkeypatch.setenv(faults.ENV, "raise@step=12")
    failed, lr_cut = _train(cfg, "cut")
    monkeypatch.delenv(faults.ENV)
    resumed, lr_resumed = _train(cfg, "cut")
    assert failed == {} and sorted(lr_cut) == list(range(1, 12))
    # The schedule's state travels in the checkpoint the resume starts from (linear: 10 of its 11 warmup steps).
    cut_at = pipe_file.parent / "runs" / "cut" / checkpoint.checkpoint_name(10)
    assert checkpoint.read_manifest(cut_at)["train_state"]["scheduler"]["last_epoch"] == 10
    assert resumed.resumed_from_step == 10 and resumed.steps == straight.steps == STEPS
    assert sorted(lr_straight) == list(range(1, STEPS + 1))
    assert {**lr_cut, **lr_resumed} == lr_straight
    # After the cut: held (constant), held then decaying (wsd), decaying at every step (cosine; linear from
    # the end of its warmup, at step 11).
    assert len(set(lr_resumed.values())) == {"constant": 1, "wsd": 5}.get(schedule, 6), lr_resumed
    a, b = _state(straight.checkpoint), _state(resumed.checkpoint)
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for name, per_param in a["optim"]["state"].items():
        for key, value in per_param.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optim"]["state"][name][key])), (name, key)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert [g["weight_decay"] for g in b["optim"]["param_groups"]] == [0.1, 0.0]


def test_the_pipelines_optimizer_and_scheduler_are_used(pipe_file):
    """The pipeline's SGD (two groups of its own) with its StepLR: the lr halves every 4 steps and
    the checkpoint holds its groups; with its optimizer alone, raylane's schedule drives it."""
    result, lr = _train(_cfg(pipe_file, "model.optimizer=own", "model.scheduler=own", "optim.schedule=cosine"), "own")
    assert result.steps == STEPS
    assert lr == {s: pytest.approx(0.05 * 0.5 ** (s // 4)) for s in range(1, STEPS + 1)}
    groups = _state(result.checkpoint)["optim"]["param_groups"]
    assert [(g["momentum"], g["weight_decay"], sorted(g["params"])) for g in groups] == [
        (0.5, 0, ["blocks.0.bias", "blocks.0.weight", "emb.weight"]),
        (0.0, 0, ["norm.bias", "norm.weight"]),
    ]

    result, lr = _train(_cfg(pipe_file, "model.optimizer=own", "optim.schedule=linear"), "own-opt")
    assert lr[8] == pytest.approx(0.05 * 0.5) and lr[16] == 0  # linear from its lr to 0 (after step s)
    assert _state(result.checkpoint)["optim"]["param_groups"][0]["momentum"] == 0.5


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.optimizer=raises"], "optimizer(model, cfg) raised ValueError: no optimizer today (at {file}:"),
        (["model.optimizer=wrong"], "optimizer(model, cfg) returned dict: it must return a torch.optim.Optimizer"),
        (
            ["model.scheduler=wrong"],
            "scheduler(optimizer, cfg, total_steps) returned ReduceLROnPlateau: it must return",
        ),
    ],
)
def test_a_broken_optimizer_or_scheduler_is_named_in_one_line(pipe_file, overrides, expected):
    with pytest.raises(UserCodeError) as caught:
        _train(_cfg(pipe_file, *overrides), "broken")
    message = str(caught.value)
    assert message.startswith(f"pipeline {str(pipe_file)!r}: {expected.format(file=pipe_file)}"), message
    assert f"(at {pipe_file}:" in message and "\n" not in message


def test_a_checkpoint_grouped_otherwise_is_refused_by_name(tmp_path):
    """Torch would load one group's settings into two and fail at the next step (KeyError:
    'betas'); the load names the change instead, and the config check before a relaunch does too."""
    model = _net()
    path = tmp_path / checkpoint.checkpoint_name(1)
    path.mkdir()
    checkpoint.save(
        path, model, torch.optim.AdamW(param_groups(model, 0.1, decay_norm_and_bias=True)), {"step": 1}, rank=0
    )
    with pytest.raises(checkpoint.CheckpointLoadError, match=r"1 parameter group there, 2 here: optim.weight_decay"):
        checkpoint.load(path, model, torch.optim.AdamW(param_groups(model, 0.1)))

    from raylane import prechecks

    saved = load_config("gpt-tiny").flat()
    del saved["optim.decay_norm_and_bias"]  # a checkpoint from before the key: one group
    assert prechecks.first_unloadable(saved, load_config("gpt-tiny").flat()) == "optim.decay_norm_and_bias"
    assert prechecks.first_unloadable(saved, load_config("gpt-tiny", ["optim.decay_norm_and_bias=true"]).flat()) is None
    assert (
        prechecks.first_unloadable(
            load_config("digits").flat(), load_config("digits", ["optim.weight_decay=0.1"]).flat()
        )
        == "optim.weight_decay"
    )
