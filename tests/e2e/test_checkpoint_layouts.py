"""Checkpoints that move between layouts (issue 49): a run saved at one layout resumes at another
(its model, its optimizer's state and hyperparameters, its LR schedule and its data position
kept) and trains on as the saving layout does uninterrupted; the resume says so in one line;
`raylane export` consolidates it whatever its layout.

`moved` is the one launch sequence: the source layout trains uninterrupted (checkpoints half-way
and at the end), then every target layout resumes from the half-way checkpoint, side by side.
Each layout is a line of LAYOUTS; a new one is one line there. A move with a pipeline layout in it
trains gpt untied at every layout (a pipeline puts the embedding and the head on different
stages: tied weights across stages are refused)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from raylane.config import load_config
from raylane.loop import checkpoint
from raylane.loop.checkpoint.state import scheduler_state_for
from raylane.loop.optim import build_optimizer, build_scheduler
from tests.conftest import TORCHRUN, read_json

pytestmark = pytest.mark.untracked

# name -> (ranks, --set overrides, the strategy's label, how the resume line names the layout)
LAYOUTS = {
    "one": (1, [], "single", "one process"),
    "tp2": (2, ["strategy.tp=2"], "tp2", "tp2 on 2"),
    "ddp2": (2, ["strategy.name=ddp"], "ddp", "ddp on 2"),
    "fsdp2": (2, ["strategy.name=fsdp"], "fsdp", "fsdp on 2"),
    "fsdp-tp": (4, ["strategy.name=fsdp", "strategy.tp=2"], "fsdp×tp2", "fsdp×tp2 on 4"),
    "pp2": (2, ["strategy.pp=2"], "pp2", "pp2 on 2"),
    "pp-fsdp": (4, ["strategy.name=fsdp", "strategy.pp=2"], "fsdp×pp2", "fsdp×pp2 on 4"),
}
UNTIED = "model.tie_embeddings=false"
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


def _untied(layouts: list[str]) -> bool:
    """Whether a move among `layouts` trains gpt untied: one of them is a pipeline's."""
    return any(s.startswith("strategy.pp=") for layout in layouts for s in LAYOUTS[layout][1])


def _launch(run_cli, name: str, layout: str, untied: bool, init_from: str | None = None, more: tuple = ()):
    ranks, extra, _, _ = LAYOUTS[layout]
    extra = [*extra, UNTIED, *more] if untied else [*extra, *more]
    sets = {**SETS, "run.name": name, **({"checkpoint.init_from": init_from} if init_from else {})}
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")] + [x for s in extra for x in ("--set", s)]
    if ranks == 1:
        head, launcher = ["train", "gpt-tiny", "--local", "--set", "scaling.num_workers=1"], {}
    else:
        head, launcher = ["--nproc_per_node", str(ranks), "-m", "raylane", "train", "gpt-tiny"], {"launcher": TORCHRUN}
    return run_cli(*head, *args, "--summary-json", f"{name}.json", name=name, **launcher)


def _loaded(path: str, untied: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """A checkpoint loaded into one plain process as a run resumes it: its model, its optimizer,
    its LR schedule (built before the load, as the run builds it)."""
    from raylane.pipelines.gpt import build

    cfg = load_config("gpt-tiny", [f"{k}={v}" for k, v in SETS.items()] + ([UNTIED] if untied else []))
    pipe = build(cfg)
    optimizer = build_optimizer(pipe.model, cfg)
    schedule = build_scheduler(optimizer, cfg, STEPS)
    state = checkpoint.load(path, pipe.model, optimizer)
    schedule.load_state_dict(scheduler_state_for(state["scheduler"], optimizer))
    return pipe.model, optimizer, schedule


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def moved(run_cli, tmp_path: Path, moves: dict[str, list[str]]) -> dict[str, dict]:
    """Each source trains STEPS steps uninterrupted (the sources side by side); each of its targets
    resumes its half-way checkpoint and trains the rest (every target side by side). Each
    target's weights after the last step are its source's within 1e-6 (the layouts' own float
    noise: a lost momentum, schedule or data position is orders more), its optimizer's groups
    keep their hyperparameters, and its start says the move in one line."""
    untied = {source: _untied([source, *targets]) for source, targets in moves.items()}
    sources = {source: _launch(run_cli, source, source, untied[source]) for source in moves}
    runs, started = {}, {}
    for source, p in sources.items():
        assert p.wait(300) == 0, p.output
        runs[source] = read_json(tmp_path / f"{source}.json")
        ranks, _, label, _ = LAYOUTS[source]
        layout = checkpoint.read_manifest(half(runs[source]))["train_state"]["layout"]
        assert (layout["strategy"], layout["world_size"]) == (label, ranks), layout
        for target in moves[source]:
            name = f"{target}-from-{source}"
            started[source, target] = _launch(run_cli, name, target, untied[source], init_from=half(runs[source]))
    for (source, target), p in started.items():
        assert p.wait(300) == 0, p.output
        ranks, label = LAYOUTS[source][0], LAYOUTS[source][2]
        run = runs[f"{target}-from-{source}"] = read_json(tmp_path / f"{target}-from-{source}.json")
        assert (run["resumed_from_step"], run["steps"]) == (STEPS // 2, STEPS)
        was = "one-process" if ranks == 1 else label
        said = f"resuming a {was} checkpoint of {ranks} rank{'s' if ranks > 1 else ''} as {LAYOUTS[target][3]}"
        lines = [line for line in p.output.splitlines() if "resuming a " in line]
        assert lines == ([] if target == source else [f"[raylane] {said}"]), p.output
        end = _weights(_loaded(runs[source]["checkpoint"], untied[source])[0])
        model, optimizer, _ = _loaded(run["checkpoint"], untied[source])
        worst = max(float((_weights(model)[k] - v).abs().max()) for k, v in end.items())
        assert worst <= 1e-6, (target, worst)
        print(f"{target} from {source}: weights within {worst:.2g} of uninterrupted")  # pytest -s shows it
        groups = [(g["momentum"], g["weight_decay"]) for g in optimizer.param_groups]
        assert groups == [(0.9, 0.01), (0.9, 0.0)], groups  # gpt-tiny's decayed and undecayed groups
    return runs


def half(run: dict) -> str:
    """A run's half-way checkpoint, the one its moves resume."""
    return str(Path(run["checkpoint"]).parent / checkpoint.checkpoint_name(STEPS // 2))


def _moved_bit_exact(path: str, untied: bool = False) -> None:
    """The checkpoint loaded into one process holds exactly what every rank wrote: each tensor of
    the model and the optimizer, and each hyperparameter, as DCP reads them raw; and its LR
    schedule is at its step, each group's lr the one a schedule stepped there gives."""
    from raylane.loop.checkpoint.state import dcp, flat_optim

    model, optimizer, schedule = _loaded(path, untied)
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

    cfg = load_config("gpt-tiny", [f"{k}={v}" for k, v in SETS.items()])
    fresh = build_optimizer(model, cfg)
    stepped = build_scheduler(fresh, cfg, STEPS)
    for _ in range(STEPS // 2):
        fresh.step()
        stepped.step()
    assert schedule.last_epoch == stepped.last_epoch == STEPS // 2
    assert [g["lr"] for g in optimizer.param_groups] == [g["lr"] for g in fresh.param_groups] != [0.3, 0.3]


def test_tensor_and_pipeline_parallel_checkpoints_resume_as_one_process(run_cli, tmp_path):
    """tp2 on 2 ranks (DTensors, one data-parallel rank) saves at step 3; one process resumes it
    and ends at its own step-6 weights within 1e-6 (onto more data-parallel ranks: the slow
    tests below, fsdp×tp2 on 4 as ddp on 2 and as fsdp×pp2). Beside it pp2 on 2 ranks (each stage writes its own
    parameters and their optimizer state, under the whole model's names) saves at step 3, and one
    process resumes it the same. Each checkpoint, loaded into one process, is what its ranks
    wrote, bit for bit, its schedule at step 3; tp2's exports to safetensors as the whole model.
    Trap e: with the optimizer state written by group index (the fix in checkpoint/writing.py
    reverted), pp2's resume fails (the stages' groups 0 collide: "does not fit this run's
    optimizer"), tp2's moves still pass (seen so)."""
    runs = moved(run_cli, tmp_path, {"tp2": ["one"], "pp2": ["one"]})
    _moved_bit_exact(half(runs["tp2"]))
    _moved_bit_exact(half(runs["pp2"]), untied=True)

    from safetensors.torch import load_file

    from raylane.export import export

    export(runs["tp2"]["checkpoint"], tmp_path / "tp2.safetensors")
    exported = load_file(tmp_path / "tp2.safetensors")
    weights = _weights(_loaded(runs["tp2"]["checkpoint"])[0])
    assert set(exported) == set(weights) and all(torch.equal(exported[k], v) for k, v in weights.items())


def _same(runs: dict, run: str, again: str, untied: bool) -> None:
    """`again` (a resume at the layout that saved) ends at `run`'s weights, bit for bit."""
    same = _weights(_loaded(runs[run]["checkpoint"], untied)[0])
    resumed = _weights(_loaded(runs[again]["checkpoint"], untied)[0])
    assert all(torch.equal(resumed[k], v) for k, v in same.items())


@pytest.mark.slow
def test_an_fsdp_tp_checkpoint_resumes_under_ddp_on_two_and_as_one_process(run_cli, tmp_path):
    """FSDP x TP on 4 ranks (2 data-parallel ranks, each a tensor-parallel pair) saves at step 3;
    DDP on 2 ranks, one process, and FSDP x TP itself resume it: the first two end within 1e-6
    of its uninterrupted weights, its own resume bit-exact."""
    runs = moved(run_cli, tmp_path, {"fsdp-tp": ["ddp2", "one", "fsdp-tp"]})
    _same(runs, "fsdp-tp", "fsdp-tp-from-fsdp-tp", untied=False)


@pytest.mark.slow
def test_an_fsdp_tp_checkpoint_resumes_under_pp_fsdp(run_cli, tmp_path):
    """gpt untied. FSDP x TP on 4 ranks saves at step 3; PP x FSDP on 4 ranks (2 stages, each
    sharded over 2 data-parallel ranks, each stage's parameters a part of the tensor-parallel
    ones) resumes it and ends within 1e-6 of its uninterrupted weights."""
    moved(run_cli, tmp_path, {"fsdp-tp": ["pp-fsdp"]})


@pytest.mark.slow
def test_a_pp_fsdp_checkpoint_resumes_as_one_process_and_under_fsdp_tp(run_cli, tmp_path):
    """gpt untied. PP x FSDP on 4 ranks saves at step 3 (each stage's shards under the whole
    model's names); one process, FSDP x TP on 4 ranks and PP x FSDP itself resume it: the first
    two end within 1e-6 of its uninterrupted weights, its own resume bit-exact. Its checkpoint,
    loaded into one process, is what its ranks wrote, bit for bit, its schedule at step 3."""
    runs = moved(run_cli, tmp_path, {"pp-fsdp": ["one", "fsdp-tp", "pp-fsdp"]})
    _same(runs, "pp-fsdp", "pp-fsdp-from-pp-fsdp", untied=True)
    _moved_bit_exact(half(runs["pp-fsdp"]), untied=True)


@pytest.mark.slow  # ~55 s on a loaded 2-core machine; make test loads such a manifest in-process (tests/unit/test_layout_type.py)
def test_a_checkpoint_whose_manifest_holds_the_old_layout_record_resumes(run_cli, tmp_path):
    """A checkpoint written before the layout had one type (issue 61), whose manifest holds the
    layout as the dict raylane wrote then (the record's first six keys: its label, flavour, tp,
    pp, data-parallel size and world size). One process with dropout (so that its random
    generators matter) trains 6 steps, saving at step 3; that checkpoint's record is cut back
    to the old dict; a run resumed from it says no move (the layout that saved it), and ends at
    the uninterrupted run's weights bit for bit: its generators were restored, which they are
    only at the layout that saved them. Its own checkpoints hold the whole record again."""
    dropout = ("model.dropout=0.1",)
    p = _launch(run_cli, "one", "one", False, more=dropout)
    assert p.wait(300) == 0, p.output
    runs = {"one": read_json(tmp_path / "one.json")}
    manifest = Path(half(runs["one"])) / checkpoint.MANIFEST_FILE
    written = json.loads(manifest.read_text())
    old = {k: written["train_state"]["layout"][k] for k in ("strategy", "name", "tp", "pp", "dp", "world_size")}
    assert old == {"strategy": "single", "name": "single", "tp": 1, "pp": 1, "dp": 1, "world_size": 1}
    written["train_state"]["layout"] = old
    manifest.write_text(json.dumps(written))

    p = _launch(run_cli, "again", "one", False, init_from=half(runs["one"]), more=dropout)
    assert p.wait(300) == 0, p.output
    runs["again"] = read_json(tmp_path / "again.json")
    assert (runs["again"]["resumed_from_step"], runs["again"]["steps"]) == (STEPS // 2, STEPS)
    assert "resuming a " not in p.output, p.output
    _same(runs, "one", "again", untied=False)
    layout = checkpoint.read_manifest(runs["again"]["checkpoint"])["train_state"]["layout"]
    assert layout["dp_shard"] == 1 and layout["model_parallel"] is False, layout
