"""Expert parallelism (`strategy.ep`, issue 65) end to end through `raylane train`: the run's own
layouts against the plain ones. Every run trains the same samples per step (train.global_batch),
fp32, AdamW; rank 0's train/loss at every step is read from MLflow, and checkpoints are compared
whole in this process (model and optimizer state by parameter name).

- A user's own torchtitan-style MoE (tests/helpers/moe_own.py) on 2 ranks under torchrun: DDP,
  DDP×ep2 and FSDP×ep2 equal at every step; their checkpoints equal DDP's; ep2 moves to FSDP on 2
  (ep 1) and to one process, and both train on to DDP's state.
- A router biased onto the first rank's experts (the other receives no token): equal, and the
  imbalance in MLflow.
- transformers' tiny Qwen2-MoE (a shared expert; Mixtral slow) through the shipped hf pipeline.
- 4 ranks: DDP×ep2 with dp_rest 2 and FSDP×ep2 with the experts sharded over dp_rest (slow), for
  the own MoE and for both transformers families (FSDP×ep2).
- `ep: 2` on 2 Ray workers of the session's shared head (slow): the own MoE, and both transformers
  families at FSDP×ep2 (their text as a mixture, drawn alike on Ray and under torchrun).
make test's part, the zygote warm, under a load average of 5: ~16 s, ~13 s and ~14 s."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from raylane.config import load_config
from raylane.loop import checkpoint, usercode
from raylane.loop.distributed.fsdp import materialize, on_meta
from raylane.loop.optim import build_optimizer
from tests.conftest import REPO, TORCHRUN, read_json

HELPER = REPO / "tests" / "helpers" / "moe_own.py"
STEPS = 8
# 64 sequences, 16 a step (at any world size: batch_size computed), 4 steps an epoch: the epoch
# ends save at steps 4 and 8, no other checkpoint.
OWN = (
    "pipeline: ./moe_own.py\n"
    f"train: {{max_steps: {STEPS}, global_batch: 16, global_batch_adjust: batch_size, seed: 3}}\n"
    "optim: {name: adamw, lr: 0.01}\n"
    "mlflow: {log_every_n_steps: 1, log_model: false, system_metrics: false}\n"
)
LOSS_GAP = 1e-5  # fp32 over 8 AdamW steps (measured: see each test)
# A checkpoint's every tensor, model and optimizer: the Done-when's 1e-5. Measured 2.4e-7 (own),
# 5.1e-7 (Qwen2-MoE), 1.1e-6 (Mixtral: float noise in an expert's near-zero gradient, which AdamW
# turns into a step); a wrong gradient scale on the experts is 1e-4 to 1e-3 off.
STATE_GAP = 1e-5


def _own(tmp_path: Path) -> Path:
    shutil.copy(HELPER, tmp_path / "moe_own.py")
    (tmp_path / "ep.yaml").write_text(OWN + f"run: {{storage_path: {tmp_path / 'runs'}}}\n")
    return tmp_path / "ep.yaml"


def _sets(*sets: str) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def _torchrun(run_cli, config: Path, name: str, *sets: str, ranks: int = 2):
    return run_cli(
        *["--nproc_per_node", str(ranks), "-m", "raylane", "train", config.name],
        *_sets(f"run.name={name}", *sets),
        *["--summary-json", f"{name}.json"],
        launcher=TORCHRUN,
        name=name,
    )


def _local(run_cli, config: Path, name: str, *sets: str):
    return run_cli(
        *["train", config.name, "--local"],
        *_sets("scaling.num_workers=1", f"run.name={name}", *sets),
        *["--summary-json", f"{name}.json"],
        name=name,
    )


def _finished(tmp_path: Path, started: dict, timeout: float = 300) -> dict[str, dict]:
    runs = {}
    for name, p in started.items():
        assert p.wait(timeout) == 0, p.output
        runs[name] = read_json(tmp_path / f"{name}.json")
        assert runs[name]["status"] == "FINISHED", runs[name]
    return runs


def _metric(tmp_path: Path, run: dict, key: str) -> dict[int, float]:
    """A metric's values by step, as the run logged them to MLflow (the test's database)."""
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        rows = con.execute("SELECT step, value FROM metrics WHERE run_uuid = ? AND key = ?", (run["run_id"], key))
        return dict(sorted(rows.fetchall()))


def _loss_gap(tmp_path: Path, run: dict, reference: dict, steps: range) -> float:
    """The largest difference of rank 0's train/loss from the reference's over `steps` (each
    logged by both)."""
    mine, theirs = _metric(tmp_path, run, "train/loss"), _metric(tmp_path, reference, "train/loss")
    assert set(steps) <= set(mine) and set(steps) <= set(theirs), (sorted(mine), sorted(theirs))
    return max(abs(mine[s] - theirs[s]) for s in steps)


def _step(run: dict, step: int) -> str:
    return str(Path(run["checkpoint"]).parent / checkpoint.checkpoint_name(step))


def _state(config: Path, path: str, *sets: str) -> dict[str, torch.Tensor]:
    """A checkpoint loaded into one plain process as a run resumes it (the model whole, the
    run's optimizer): every model tensor and every optimizer state tensor by parameter name."""
    cfg = load_config(config, list(sets))
    pipe = usercode.build_pipeline(cfg)
    if on_meta(pipe.model):  # the hf pipeline's: weights are the checkpoint's anyway
        materialize(pipe.model, torch.device("cpu"))
    optimizer = build_optimizer(pipe.model, cfg)
    checkpoint.load(path, pipe.model, optimizer)
    names = {p: n for n, p in pipe.model.named_parameters()}
    state = {f"model {k}": v.detach() for k, v in pipe.model.state_dict().items()}
    for p, kept in optimizer.state.items():
        state |= {f"optim {names[p]} {k}": torch.as_tensor(v) for k, v in kept.items()}
    assert any(k.startswith("optim ") and k.endswith("exp_avg_sq") for k in state), sorted(state)
    return state


def _state_gap(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    assert sorted(mine) == sorted(theirs)
    return max(float((mine[k].float() - theirs[k].float()).abs().max()) for k in mine)


# name -> (ranks, --set overrides); each test launches some of them side by side.
LAYOUTS = {
    "ddp": (2, ["strategy.name=ddp"]),
    "ddp-ep": (2, ["strategy.name=ddp", "strategy.ep=2"]),
    "fsdp-ep": (2, ["strategy.name=fsdp", "strategy.ep=2"]),
    "ddp4": (4, ["strategy.name=ddp"]),
    "ddp4-ep": (4, ["strategy.name=ddp", "strategy.ep=2"]),
    "fsdp4-ep": (4, ["strategy.name=fsdp", "strategy.ep=2"]),
    "fsdp4": (4, ["strategy.name=fsdp"]),
}


def _trained(run_cli, tmp_path: Path, config: Path, names: list[str], *sets: str) -> dict[str, dict]:
    """The runs of LAYOUTS `names` side by side, each FINISHED; their summaries."""
    started = {}
    for name in names:
        ranks, extra = LAYOUTS[name]
        started[name] = _torchrun(run_cli, config, name, *extra, *sets, ranks=ranks)
    return _finished(tmp_path, started)


def _match(tmp_path: Path, config: Path, runs: dict[str, dict], reference: str, *sets: str) -> None:
    """Every run's loss at every step within LOSS_GAP of the reference's, and its last checkpoint
    (loaded into one process) within STATE_GAP of the reference's, model and AdamW state."""
    theirs = _state(config, runs[reference]["checkpoint"], *sets)
    for name, run in runs.items():
        if name == reference:
            continue
        loss = _loss_gap(tmp_path, run, runs[reference], range(1, run["steps"] + 1))
        state = _state_gap(_state(config, run["checkpoint"], *sets), theirs)
        print(f"{name}: losses within {loss:.2g}, checkpoint within {state:.2g} of {reference}'s")  # pytest -s
        assert loss <= LOSS_GAP and state <= STATE_GAP, (name, loss, state)


def _match_one(tmp_path: Path, config: Path, runs: dict[str, dict], one: dict, *sets: str) -> None:
    """Every run's last checkpoint within STATE_GAP of one process's that trained the same rows
    in batches as large as their global batch (`one`), model and AdamW state: the gradients
    each step applied, summed over every rank, are the one process's (a rank's own loss is of its
    own rows, so losses are compared at the same world size, by _match)."""
    theirs = _state(config, one["checkpoint"], *sets)
    assert one["world_size"] == 1 and all(run["steps"] == one["steps"] for run in runs.values()), one
    for name, run in runs.items():
        state = _state_gap(_state(config, run["checkpoint"], *sets), theirs)
        print(f"{name}: checkpoint within {state:.2g} of one process's")  # pytest -s
        assert state <= STATE_GAP, (name, state)


def test_own_moe_at_ep2_matches_ddp_and_its_checkpoints_move_to_fsdp_and_one_process(run_cli, tmp_path):
    """The own MoE (4 experts in each of 2 layers, top-2) on 2 ranks: DDP, DDP×ep2 (the experts
    kept out of DDP, their gradients reduced by a hook) and FSDP×ep2 (each experts module an FSDP2
    unit of its own), side by side, 8 AdamW steps: rank 0's loss within 1e-5 of DDP's at every
    step (measured: equal, 4.8e-7 at worst), the strategy said as ddp×ep2 and fsdp×ep2; their
    step-8 checkpoints, loaded into one plain process, hold DDP's model and AdamW state within
    1e-5 (measured 2.4e-7). The optimizer's state is what catches a wrong gradient scale on the
    experts, which AdamW's update and so the losses hardly show: with FSDP2 dividing the experts'
    gradients twice at dp_rest 1 (expert_layout.shard_experts_fsdp's fix undone) the losses still
    agree to 5e-7 and exp_avg is half DDP's (1.1e-3 off). FSDP×ep2's step-4
    checkpoint resumed as FSDP on 2 ranks (ep 1) and as one process (--local), side by side,
    trains on to step 8: FSDP's losses are DDP's at steps 5-8, and both step-8 checkpoints hold
    DDP's model and optimizer state (ep2 -> FSDP on 2 -> one process)."""
    config = _own(tmp_path)
    runs = _trained(run_cli, tmp_path, config, ["ddp", "ddp-ep", "fsdp-ep"])
    assert [runs[n]["strategy"] for n in runs] == ["ddp", "ddp×ep2", "fsdp×ep2"]
    _match(tmp_path, config, runs, "ddp")

    half = _step(runs["fsdp-ep"], STEPS // 2)
    moves = {
        "fsdp-from-ep": _torchrun(
            run_cli, config, "fsdp-from-ep", "strategy.name=fsdp", f"checkpoint.init_from={half}"
        ),
        "one-from-ep": _local(run_cli, config, "one-from-ep", f"checkpoint.init_from={half}"),
    }
    moved = _finished(tmp_path, moves)
    assert (moved["fsdp-from-ep"]["strategy"], moved["one-from-ep"]["world_size"]) == ("fsdp", 1)
    # The checkpoint's layout record holds ep: each move says where it came from.
    assert "resuming a fsdp×ep2 checkpoint of 2 ranks as one process" in moves["one-from-ep"].output
    assert "resuming a fsdp×ep2 checkpoint of 2 ranks as fsdp on 2" in moves["fsdp-from-ep"].output
    gap = _loss_gap(tmp_path, moved["fsdp-from-ep"], runs["ddp"], range(STEPS // 2 + 1, STEPS + 1))
    assert gap <= LOSS_GAP, gap
    ddp = _state(config, runs["ddp"]["checkpoint"])
    for name, run in moved.items():
        assert (run["resumed_from_step"], run["steps"]) == (STEPS // 2, STEPS), run
        gap = _state_gap(_state(config, run["checkpoint"]), ddp)
        print(f"{name}: checkpoint within {gap:.2g} of ddp's")
        assert gap <= STATE_GAP, (name, gap)


@pytest.mark.slow  # ~43 s, 16 ranks on 2 cores; make test runs DDP×ep2 and FSDP×ep2 on 2 (dp_rest 1) above
def test_own_moe_at_ep2_on_four_ranks_matches_ddp_and_fsdp(run_cli, tmp_path):
    """4 ranks, 8 AdamW steps: DDP×ep2 (dp_rest 2: the gradient hook's all-reduce over the
    ranks that hold the same experts) and FSDP×ep2 (the experts sharded over dp_rest too), and
    FSDP, each within 1e-5 of DDP's loss at every step and 1e-5 of its checkpoint (measured 4.8e-7
    and 1.2e-7); every checkpoint within 1e-5 of one process's that trained the same 16 rows a
    step (--local)."""
    config = _own(tmp_path)
    one = _local(run_cli, config, "one")
    runs = _trained(run_cli, tmp_path, config, ["ddp4", "ddp4-ep", "fsdp4-ep", "fsdp4"])
    assert [runs[n]["strategy"] for n in runs] == ["ddp", "ddp×ep2", "fsdp×ep2", "fsdp"]
    _match(tmp_path, config, runs, "ddp4")
    _match_one(tmp_path, config, runs, _finished(tmp_path, {"one": one})["one"])


# Slow (~11 s): make test has a router collapsed onto one rank's experts under ep2 (no hang, nothing
# dropped, one process's losses: tests/e2e/test_expert_parallel.py) and its imbalance in the
# window figures (tests/unit/test_expert_metrics.py).
@pytest.mark.slow
def test_a_router_biased_onto_one_ranks_experts_trains_at_ep2_as_ddp_and_mlflow_shows_it(run_cli, tmp_path):
    """model.bias_router: every token's top-2 are experts 0 and 1 (rank 0's at ep 2: rank 1's
    experts receive nothing, a forward's all-to-all sends it no row). DDP×ep2 and FSDP×ep2 on 2
    ranks neither hang nor drift: every step's loss and the step-8 checkpoint are DDP's (the idle
    experts' AdamW state zero). Nothing is dropped silently: each step's window in MLflow says
    rank 0's imbalance (2.0: experts 0 and 1 take all, 2 and 3 nothing) and no drop, and the
    summary counts every rank's pairs, none dropped."""
    config = _own(tmp_path)
    runs = _trained(run_cli, tmp_path, config, ["ddp", "ddp-ep", "fsdp-ep"], "model.bias_router=true")
    _match(tmp_path, config, runs, "ddp", "model.bias_router=true")
    state = _state(config, runs["fsdp-ep"]["checkpoint"], "model.bias_router=true")
    idle = state["optim layers.0.moe.experts.w_in exp_avg"]
    assert idle[2:].abs().max() == 0 and idle[:2].abs().max() > 0, idle.abs().amax((1, 2))
    pairs = STEPS * 2 * 2 * 8 * 8 * 2  # steps x ranks x layers x (8 sequences of 8 tokens) x top-2
    for name in ("ddp-ep", "fsdp-ep"):
        windows = {
            key: list(_metric(tmp_path, runs[name], f"train/experts/{key}").values())
            for key in ("imbalance", "dropped_tokens")
        }
        assert windows == {"imbalance": [2.0] * STEPS, "dropped_tokens": [0.0] * STEPS}, (name, windows)
        told = runs[name]["experts"]
        assert (told["routed"], told["tokens_min"], told["dropped"], told["imbalance"]) == (pairs, 0, 0, 2.0), told


def _hf_project(tmp_path: Path, family: str, n: int = 64) -> Path:
    """A tiny `family` MoE saved here (tests/helpers/ep_ranks.py's: 4 experts, top-2), its text
    in two files (one per rank: the hf pipeline reads a file per rank), and a config."""
    from tests.helpers import hf_tiny
    from tests.helpers.ep_ranks import tiny_moe

    model = hf_tiny.save(tiny_moe(family), tmp_path / family)
    data = hf_tiny.rows(tmp_path / "data", n=n)
    lines = (data / "train.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "tr").mkdir()
    (tmp_path / "tr" / "a.jsonl").write_text("".join(lines[: n // 2]))
    (tmp_path / "tr" / "b.jsonl").write_text("".join(lines[n // 2 :]))
    config = tmp_path / "ep.yaml"
    config.write_text(
        f"pipeline: hf\nmodel: {{task: causal-lm, seq_len: 32, name_or_path: {model}}}\n"
        "data: {format: json, train: tr}\n"
        "train: {max_steps: 6, batch_size: 4, seed: 1}\noptim: {name: adamw, lr: 0.001}\n"
        "checkpoint: {every_n_epochs: 0}\n"
        "mlflow: {log_every_n_steps: 1, log_model: false, system_metrics: false}\n"
    )
    return config


@pytest.mark.parametrize(
    "family", ["qwen2_moe", pytest.param("mixtral", marks=pytest.mark.slow)], ids=["qwen2-moe", "mixtral"]
)
def test_a_transformers_moe_at_ep2_trains_as_under_ddp(run_cli, tmp_path, family):
    """transformers' tiny Qwen2-MoE (a shared expert beside the 4 routed ones; grouped matmul)
    and Mixtral (make test: Qwen2-MoE; Mixtral slow, the same path with transformers' eager
    experts loop) through the shipped hf pipeline and transformers' own ep_plan, 2 ranks, 6 AdamW
    steps: DDP×ep2 and FSDP×ep2 within 1e-5 of DDP's loss at every step (measured: equal for
    Qwen2-MoE, 4.8e-7 for Mixtral), their checkpoints (model and AdamW state) within 1e-5 of
    DDP's (5.1e-7 Qwen2-MoE, 1.1e-6 Mixtral)."""
    pytest.importorskip("transformers")
    config = _hf_project(tmp_path, family)
    runs = _trained(run_cli, tmp_path, config, ["ddp", "ddp-ep", "fsdp-ep"])
    assert [runs[n]["strategy"] for n in runs] == ["ddp", "ddp×ep2", "fsdp×ep2"]
    _match(tmp_path, config, runs, "ddp")


# ~47 s with the head up, under a load average of 5: make test runs ep2 under torchrun (above) and
# Ray's workers through the same loop (test_any_model.py, test_ray_e2e.py).
@pytest.mark.slow
@pytest.mark.shared_ray
def test_ep2_on_two_ray_workers_trains_as_ddp_under_torchrun(run_cli, tmp_path):
    """`strategy.ep: 2` on 2 Ray Train workers of the session's head (Ray's gloo group, the same
    loop) beside DDP on 2 ranks under torchrun, the same seed and samples: FINISHED as ddp×ep2,
    every step's loss within 1e-5 of DDP's and the step-8 checkpoint too, and both checkpoints
    within 1e-5 of one process's (--local, the same 16 rows a step)."""
    config = _own(tmp_path)
    started = {
        "ddp": _torchrun(run_cli, config, "ddp", *LAYOUTS["ddp"][1]),
        "ray-ep": run_cli(
            *["train", config.name, *_sets("scaling.num_workers=2", "run.name=ray-ep", *LAYOUTS["ddp-ep"][1])],
            *["--summary-json", "ray-ep.json"],
            name="ray-ep",
        ),
    }
    started["one"] = _local(run_cli, config, "one")
    runs = _finished(tmp_path, started)
    assert (runs["ray-ep"]["strategy"], runs["ray-ep"]["world_size"]) == ("ddp×ep2", 2)
    one = runs.pop("one")
    _match(tmp_path, config, runs, "ddp")
    _match_one(tmp_path, config, runs, one)


def _hf_mixed(tmp_path: Path, family: str) -> Path:
    """_hf_project's model and 1,024 documents drawn as a mixture of its two files (data.mix): read whole
    by every rank and drawn the same at any world size and on any door, so runs on 4 ranks, and on
    Ray's workers beside torchrun's ranks, train on the same rows (Ray Data's streamed order, which
    the plain files take on Ray, cannot be replayed)."""
    config = _hf_project(tmp_path, family, n=1024)
    mix = "data:\n  format: json\n  mix:\n" + "".join(
        f"    - {{name: {n}, train: tr/{n}.jsonl, weight: 0.5}}\n" for n in ("a", "b")
    )
    text = config.read_text().replace("data: {format: json, train: tr}\n", mix)
    config.write_text(text.replace("max_steps: 6,", "max_steps: 10,"))  # the Done-when's 10 AdamW steps
    return config


# ~20-35 s each: 2 runs of 4 ranks and one process on 2 cores; make test runs transformers' Qwen2-MoE at ep2 on 2
# ranks (above) and the own MoE's layouts on 4 ranks (slow, above).
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"], ids=["qwen2-moe", "mixtral"])
def test_a_transformers_moe_at_fsdp_ep2_on_four_ranks_trains_as_ddp(run_cli, tmp_path, family):
    """Qwen2-MoE and Mixtral through the hf pipeline on 4 ranks, 10 AdamW steps: FSDP×ep2 (the
    experts split over ep and sharded over the other 2 data-parallel ranks, the dense layers
    over all 4) within 1e-5 of DDP's loss at every step and of its checkpoint, model and AdamW
    state; both checkpoints within 1e-5 of one process's that trained the same 16 rows a step
    (--local; measured 2.7e-6 at most, Qwen2-MoE's FSDP×ep2). The text is long enough that 10 steps
    stay in the first epoch: at its end the ranks' sampler pads its share to equal lengths, and
    the steps after hold other rows than one process's (64 documents: 1.5e-2 off, DDP's too)."""
    pytest.importorskip("transformers")
    config = _hf_mixed(tmp_path, family)
    one = _local(run_cli, config, "one", "train.batch_size=16")  # 4 ranks x 4
    runs = _trained(run_cli, tmp_path, config, ["ddp4", "fsdp4-ep"])
    assert [runs[n]["strategy"] for n in runs] == ["ddp", "fsdp×ep2"]
    _match(tmp_path, config, runs, "ddp4")
    _match_one(tmp_path, config, runs, _finished(tmp_path, {"one": one})["one"])


# ~35 s each with the head up: make test runs the own MoE's ep2 under torchrun (above) and
# Ray's workers through the same loop (test_any_model.py, test_ray_e2e.py).
@pytest.mark.slow
@pytest.mark.shared_ray
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"], ids=["qwen2-moe", "mixtral"])
def test_a_transformers_moe_at_ep2_on_two_ray_workers_trains_as_ddp_under_torchrun(run_cli, tmp_path, family):
    """Qwen2-MoE and Mixtral through the hf pipeline, FSDP×ep2 on 2 Ray Train workers of the
    session's head beside DDP on 2 ranks under torchrun, the same rows, 10 AdamW steps: every
    step's loss within 1e-5 of DDP's and the last checkpoint too, model and AdamW state, and both
    checkpoints within 1e-5 of one process's (--local, the 8 rows of a step in one batch; measured
    4.2e-7 at most)."""
    pytest.importorskip("transformers")
    config = _hf_mixed(tmp_path, family)
    started = {
        "ddp": _torchrun(run_cli, config, "ddp", *LAYOUTS["ddp"][1]),
        "ray-ep": run_cli(
            *["train", config.name, *_sets("scaling.num_workers=2", "run.name=ray-ep", *LAYOUTS["fsdp-ep"][1])],
            *["--summary-json", "ray-ep.json"],
            name="ray-ep",
        ),
    }
    started["one"] = _local(run_cli, config, "one", "train.batch_size=8")  # 2 ranks x 4
    runs = _finished(tmp_path, started)
    assert (runs["ray-ep"]["strategy"], runs["ray-ep"]["world_size"]) == ("fsdp×ep2", 2)
    one = runs.pop("one")
    _match(tmp_path, config, runs, "ddp")
    _match_one(tmp_path, config, runs, one)


# ~15 s: 2 torchruns; make test proves the choice in-process (tests/unit/test_expert_auto.py) and
# runs ep2 under torchrun (above).
@pytest.mark.slow
def test_ep_auto_chooses_on_the_ranks_and_trains_as_the_degree_it_chose(run_cli, tmp_path):
    """`strategy.ep: auto` under torchrun on 2 ranks: with a device too small for any degree
    (scaling.device_memory_gb) the ranks choose the largest, ep 2, say so on the strategy line,
    and train as DDP does (every step's loss, the checkpoint); with the host's memory, every
    expert fits on every rank and the choice is ep 1, plain DDP."""
    config = _own(tmp_path)
    started = {
        "ddp": _torchrun(run_cli, config, "ddp", "strategy.name=ddp"),
        "small": _torchrun(
            run_cli, config, "small", "strategy.name=ddp", "strategy.ep=auto", "scaling.device_memory_gb=1e-6"
        ),
        "roomy": _torchrun(run_cli, config, "roomy", "strategy.name=ddp", "strategy.ep=auto"),
    }
    runs = _finished(tmp_path, started)
    assert (runs["small"]["strategy"], runs["roomy"]["strategy"]) == ("ddp×ep2", "ddp"), runs
    assert "strategy.ep: auto → 2: DDP needs ~" in started["small"].output, started["small"].output
    assert "none of ep 1, 2 fits: the largest" in started["small"].output
    assert "strategy.ep: auto → 1: DDP needs ~" in started["roomy"].output, started["roomy"].output
    _match(tmp_path, config, {k: runs[k] for k in ("ddp", "small")}, "ddp")
