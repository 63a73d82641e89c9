"""A run stopped part-way and resumed on 2 FSDP ranks under torchrun keeps its optimizer's parameter
groups exactly (the optimizer and schedules themselves: tests/unit/test_optim.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from raylane.config import load_config
from raylane.loop import checkpoint
from raylane.loop.optim import build_optimizer
from tests.conftest import REPO, TORCHRUN, read_json

HELPER = REPO / "tests" / "helpers" / "optim_pipe.py"
STEPS = 16  # 64 rows, 8 a step, 2 epochs


@pytest.fixture
def pipe_file(tmp_path) -> Path:
    shutil.copy(HELPER, tmp_path / "pipe.py")
    return tmp_path / "pipe.py"


def _net():
    import importlib.util

    spec = importlib.util.spec_from_file_location("optim_pipe", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net()


def _names(model: torch.nn.Module, groups: list[dict]) -> list[set[str]]:
    named = {id(p): n for n, p in model.named_parameters()}
    return [{named[id(p)] for p in g["params"]} for g in groups]


@pytest.mark.untracked
@pytest.mark.slow  # ~20 s of torchrun; make test resumes every schedule and the groups exactly in one process
def test_fsdp_on_two_ranks_resumes_its_parameter_groups_exactly(run_cli, pipe_file, tmp_path):
    """FSDP2 (DTensor parameters, fused AdamW), 2 gloo ranks: a run started from another's step-10
    checkpoint ends bit for bit where that one did at step 16, and the sharded checkpoint loads into
    one process with its two groups (decay 0.1 on the weights, none on the bias and the norm)."""
    (tmp_path / "cfg.yaml").write_text(
        "pipeline: ./pipe.py\ntrain: {batch_size: 4, max_epochs: 2, eval_every_n_epochs: 0}\nstrategy: {name: fsdp}\n"
        "optim: {name: adamw, lr: 0.05, weight_decay: 0.1, schedule: wsd, warmup_steps: 3, decay_fraction: 0.5}\n"
        "checkpoint: {every_n_steps: 10, every_n_epochs: 0}\n"
    )
    common = ["--nproc_per_node", "2", "-m", "raylane", "train", "cfg.yaml"]
    first = run_cli(*common, "--set", "run.name=s", "--summary-json", "s.json", launcher=TORCHRUN, name="s")
    assert first.wait(300) == 0, first.output
    straight = read_json(tmp_path / "s.json")
    mid = str(Path(straight["checkpoint"]).parent / checkpoint.checkpoint_name(10))
    again = run_cli(
        *common,
        "--set",
        "run.name=r",
        "--set",
        f"checkpoint.init_from={mid}",
        "--summary-json",
        "r.json",
        launcher=TORCHRUN,
        name="r",
    )
    assert again.wait(300) == 0, again.output
    resumed = read_json(tmp_path / "r.json")
    assert (resumed["strategy"], resumed["resumed_from_step"], resumed["steps"]) == ("fsdp", 10, STEPS)
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(checkpoint.read_manifest(resumed["checkpoint"])["files"])

    cfg = load_config(tmp_path / "cfg.yaml")
    loaded = []
    for summary in (straight, resumed):
        model = _net()
        optimizer = build_optimizer(model, cfg)
        checkpoint.load(summary["checkpoint"], model, optimizer)
        loaded.append((model, optimizer))
    (a, opt_a), (b, opt_b) = loaded
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert torch.equal(opt_a.state[p]["exp_avg_sq"], opt_b.state[q]["exp_avg_sq"]), name
    assert [g["weight_decay"] for g in opt_b.param_groups] == [0.1, 0.0]
    assert _names(b, opt_b.param_groups) == [
        {"emb.weight", "blocks.0.weight"},
        {"blocks.0.bias", "norm.weight", "norm.bias"},
    ]
