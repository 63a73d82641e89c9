"""Checkpoints that move between layouts (issue 49): a run saved at one layout resumes at another
(its model, its optimizer's state and hyperparameters, its LR schedule and its data position
kept) and trains on as the saving layout does uninterrupted; the resume says so in one line;
`raylane export` consolidates it whatever its layout.

`moved` is the one launch sequence: the source layout trains uninterrupted (checkpoints half-way
and at the end), then every target layout resumes from the half-way checkpoint, side by side.
Each layout is a line of LAYOUTS; a new one (PP x FSDP, say) is one line there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raylane.config import load_config
from raylane.loop import checkpoint
from raylane.loop.optim import build_optimizer
from tests.conftest import TORCHRUN, read_json

pytestmark = pytest.mark.untracked

# name -> (ranks, --set overrides, the strategy's label, how the resume line names the layout)
LAYOUTS = {
    "one": (1, [], "single", "one process"),
    "tp2": (2, ["strategy.tp=2"], "tp2", "tp2 on 2"),
    "ddp2": (2, ["strategy.name=ddp"], "ddp", "ddp on 2"),
    "fsdp2": (2, ["strategy.name=fsdp"], "fsdp", "fsdp on 2"),
    "fsdp-tp": (4, ["strategy.name=fsdp", "strategy.tp=2"], "fsdp×tp2", "fsdp×tp2 on 4"),
    # With pipeline parallelism merged: "pp-fsdp": (4, ["strategy.name=fsdp", "strategy.pp=2"], "fsdp×pp2", "fsdp×pp2 on 4"),
}
STEPS = 6
# SGD with momentum (state to move), a schedule (its position to move), weight decay on one of the
# two parameter groups; 32 samples a step however the ranks split them (one global order: the
# data position is the same sample at every layout). SGD, as issue 49's study found: AdamW turns
# the float noise of near-zero gradients into whole steps.
SETS = {
    "train.max_steps": STEPS,
    "checkpoint.every_n_steps": STEPS // 2,
    "train.global_batch": 32,
    "optim.name": "sgd",
    "optim.lr": 0.3,
    "optim.momentum": 0.9,
    "optim.warmup_steps": 2,
    "mlflow.log_model": "false",
}


def _launch(run_cli, name: str, layout: str, init_from: str | None = None):
    ranks, extra, _, _ = LAYOUTS[layout]
    sets = {**SETS, "run.name": name, **({"checkpoint.init_from": init_from} if init_from else {})}
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")] + [x for s in extra for x in ("--set", s)]
    if ranks == 1:
        head, launcher = ["train", "gpt-tiny", "--local", "--set", "scaling.num_workers=1"], {}
    else:
        head, launcher = ["--nproc_per_node", str(ranks), "-m", "raylane", "train", "gpt-tiny"], {"launcher": TORCHRUN}
    return run_cli(*head, *args, "--summary-json", f"{name}.json", name=name, **launcher)


def _loaded(path: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A checkpoint loaded into one plain process: its model and its optimizer."""
    from raylane.pipelines.gpt import build

    cfg = load_config("gpt-tiny", [f"{k}={v}" for k, v in SETS.items()])
    pipe = build(cfg)
    optimizer = build_optimizer(pipe.model, cfg)
    checkpoint.load(path, pipe.model, optimizer)
    return pipe.model, optimizer


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def moved(run_cli, tmp_path: Path, source: str, targets: list[str]) -> dict[str, dict]:
    """The source trains STEPS steps uninterrupted; each target resumes its half-way checkpoint
    and trains the rest. Each target's weights after the last step are the source's within 1e-6
    (the layouts' own float noise: a lost momentum, schedule or data position is orders more),
    its optimizer's groups keep their hyperparameters, and its start says the move in one line."""
    p = _launch(run_cli, source, source)
    assert p.wait(300) == 0, p.output
    runs = {source: read_json(tmp_path / f"{source}.json")}
    half = str(Path(runs[source]["checkpoint"]).parent / checkpoint.checkpoint_name(STEPS // 2))
    ranks, _, label, _ = LAYOUTS[source]
    layout = checkpoint.read_manifest(half)["train_state"]["layout"]
    assert (layout["strategy"], layout["world_size"]) == (label, ranks), layout
    started = {t: _launch(run_cli, f"{t}-from-{source}", t, init_from=half) for t in targets}
    end = _weights(_loaded(runs[source]["checkpoint"])[0])
    was = "one-process" if ranks == 1 else label
    for target, p in started.items():
        assert p.wait(300) == 0, p.output
        run = runs[f"{target}-from-{source}"] = read_json(tmp_path / f"{target}-from-{source}.json")
        assert (run["resumed_from_step"], run["steps"]) == (STEPS // 2, STEPS)
        said = f"resuming a {was} checkpoint of {ranks} rank{'s' if ranks > 1 else ''} as {LAYOUTS[target][3]}"
        lines = [line for line in p.output.splitlines() if "resuming a " in line]
        assert lines == ([] if target == source else [f"[raylane] {said}"]), p.output
        model, optimizer = _loaded(run["checkpoint"])
        worst = max(float((_weights(model)[k] - v).abs().max()) for k, v in end.items())
        assert worst <= 1e-6, (target, worst)
        print(f"{target} from {source}: weights within {worst:.2g} of uninterrupted")  # pytest -s shows it
        groups = [(g["momentum"], g["weight_decay"]) for g in optimizer.param_groups]
        assert groups == [(0.9, 0.01), (0.9, 0.0)], groups  # gpt-tiny's decayed and undecayed groups
    return runs


def _moved_bit_exact(path: str) -> None:
    """The checkpoint loaded into one process holds exactly what every rank wrote: each tensor of
    the model and the optimizer, and each hyperparameter, as DCP reads them raw."""
    from raylane.loop.checkpoint.state import dcp, flat_optim

    model, optimizer = _loaded(path)
    weights = checkpoint.live_state(model, optimizer)["model"]
    loaded = flat_optim(checkpoint.live_state(model, optimizer)["optim"])
    raw = {
        "model": {k: torch.empty_like(v) for k, v in weights.items()},
        "optim": {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in loaded.items()},
    }
    dcp().load(raw, checkpoint_id=path, no_dist=True)
    assert all(torch.equal(raw["model"][k], v) for k, v in weights.items())
    for key, value in loaded.items():
        same = torch.equal(raw["optim"][key], value) if isinstance(value, torch.Tensor) else raw["optim"][key] == value
        assert same, key


def test_a_tensor_parallel_checkpoint_resumes_as_one_process_and_under_fsdp_on_two(run_cli, tmp_path):
    """tp2 on 2 ranks (DTensors, one data-parallel rank) saves at step 3; one process (one
    data-parallel rank) and FSDP on 2 ranks (two, each half of a step's samples) resume it and
    end at its own step-6 weights within 1e-6. Its checkpoint, loaded into one process, is what
    its ranks wrote, bit for bit; it exports to safetensors as the whole model."""
    runs = moved(run_cli, tmp_path, "tp2", ["one", "fsdp2"])
    half = str(Path(runs["tp2"]["checkpoint"]).parent / checkpoint.checkpoint_name(STEPS // 2))
    _moved_bit_exact(half)

    from safetensors.torch import load_file

    from raylane.export import export

    export(runs["tp2"]["checkpoint"], tmp_path / "tp2.safetensors")
    exported = load_file(tmp_path / "tp2.safetensors")
    weights = _weights(_loaded(runs["tp2"]["checkpoint"])[0])
    assert set(exported) == set(weights) and all(torch.equal(exported[k], v) for k, v in weights.items())


@pytest.mark.slow
def test_an_fsdp_tp_checkpoint_resumes_under_ddp_on_two_and_as_one_process(run_cli, tmp_path):
    """FSDP x TP on 4 ranks (2 data-parallel ranks, each a tensor-parallel pair) saves at step 3;
    DDP on 2 ranks, one process, and FSDP x TP itself resume it: the first two end within 1e-6
    of its uninterrupted weights, its own resume bit-exact."""
    runs = moved(run_cli, tmp_path, "fsdp-tp", ["ddp2", "one", "fsdp-tp"])
    same = _weights(_loaded(runs["fsdp-tp"]["checkpoint"])[0])
    again = _weights(_loaded(runs["fsdp-tp-from-fsdp-tp"]["checkpoint"])[0])
    assert all(torch.equal(again[k], v) for k, v in same.items())
