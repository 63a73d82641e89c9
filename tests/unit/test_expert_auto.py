"""`strategy.ep: auto` (issue 65): the degree the memory estimate picks on the ranks
(raylane.loop.distributed.expert_auto), on a user's own torchtitan-style MoE (tests/helpers/
moe_own.py) built as a run builds it: the smallest degree dividing the data-parallel ranks and the
experts at which a rank's share fits the device, 1 where every expert fits, the largest where none
does, 1 with the reason for a pipeline without a plan and on one rank; and the config's side:
`auto` loads, is refused beside what ep does not combine with, and passes the layout checks on any
world (the ranks choose a degree that divides it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from raylane import api
from raylane.config import load_config
from raylane.errors import ConfigError
from raylane.loop import usercode
from raylane.loop.distributed.devices import GIB
from raylane.loop.distributed.expert_auto import choose_ep, expert_needs
from raylane.loop.distributed.parallelize import AUTO_MARGIN, estimate_memory
from tests.conftest import REPO

HELPER = REPO / "tests" / "helpers" / "moe_own.py"


@pytest.fixture
def config(tmp_path) -> Path:
    shutil.copy(HELPER, tmp_path / "moe_own.py")
    (tmp_path / "train.yaml").write_text(
        "pipeline: ./moe_own.py\nstrategy: {ep: auto}\noptim: {name: adamw}\nscaling:\n  num_workers: 4\n"
        f"mlflow:\n  enabled: false\nrun:\n  storage_path: {tmp_path / 'runs'}\n"
    )
    return tmp_path / "train.yaml"


def _choose(config: Path, world: int, name: str, budget: float | None, *sets: str) -> tuple[int, str]:
    over = [f"scaling.device_memory_gb={budget / GIB}"] if budget else []
    cfg = load_config(config, [*over, *sets])
    pipe = usercode.build_pipeline(cfg)
    estimate = estimate_memory(pipe.model, cfg, world, None, None)
    return choose_ep(pipe.model, pipe.ep_plan, cfg, world, name, estimate, torch.device("cpu"))


def _needs(config: Path, world: int, name: str, *sets: str) -> dict[int, int]:
    cfg = load_config(config, list(sets))
    pipe = usercode.build_pipeline(cfg)
    needs = expert_needs(
        pipe.model, pipe.ep_plan, cfg, world, name, estimate_memory(pipe.model, cfg, world, None, None)
    )
    assert isinstance(needs, dict), needs
    return needs


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_the_smallest_degree_whose_share_fits_is_chosen(config, name):
    needs = _needs(config, 4, name)
    # 4 experts in each layer on 4 ranks: 1, 2 and 4 divide both; each degree holds less.
    assert list(needs) == [1, 2, 4] and needs[1] > needs[2] > needs[4], needs
    between = {d: (needs[d] + (needs.get(2 * d) or needs[d] * 0.9)) / 2 / AUTO_MARGIN for d in needs}
    assert _choose(config, 4, name, 10 * needs[1] / AUTO_MARGIN)[0] == 1  # every expert fits everywhere
    assert _choose(config, 4, name, between[1])[0] == 2  # ep 1 does not fit, ep 2 does
    assert _choose(config, 4, name, between[2])[0] == 4
    ep, why = _choose(config, 4, name, between[4])  # not even ep 4 fits: the largest, said
    assert (
        ep == 4
        and why.startswith(f"strategy.ep: auto → 4: {name.upper()} needs ~")
        and why.endswith("none of ep 1, 2, 4 fits: the largest")
    ), why


def test_ddp_saves_the_experts_state_and_buckets_fsdp_only_the_gathered_module(config):
    """Under DDP a degree d holds (1 - 1/d) less of the experts' parameters, gradients and two
    AdamW states, and takes the experts out of DDP's buckets; under FSDP, whose state is sharded
    over every rank already, only the gathered experts module shrinks (the largest, twice)."""
    cfg = load_config(config, [])
    pipe = usercode.build_pipeline(cfg)
    experts = [m for n, m in pipe.model.named_modules() if n.endswith("moe.experts")]
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in experts]
    ddp, fsdp = _needs(config, 4, "ddp"), _needs(config, 4, "fsdp")
    assert ddp[1] - ddp[2] == int(sum(sizes) * 4 * 0.5) + sum(sizes)
    assert fsdp[1] - fsdp[4] == int(2 * max(sizes) * 0.75)


def test_only_degrees_that_divide_the_experts_and_the_ranks(config):
    assert list(_needs(config, 4, "ddp", "model.experts=2")) == [1, 2]
    assert list(_needs(config, 6, "ddp")) == [1, 2]  # 3 and 6 divide the ranks, not the 4 experts
    assert _choose(config, 6, "ddp", 1.0, "model.experts=2")[0] == 2


@pytest.mark.parametrize(
    ("world", "sets", "reason"),
    [
        (1, [], "strategy.ep: auto → 1 (one rank)"),
        (4, ["model.plan=none"], "strategy.ep: auto → 1 (the pipeline gives no ep_plan)"),
        (4, ["model.plan=no_module"], "strategy.ep: auto → 1 (Pipeline.ep_plan: 'layers.*.moe.expert' names no"),
    ],
)
def test_one_rank_no_plan_or_no_experts_is_ep_1_and_says_why(config, world, sets, reason):
    ep, why = _choose(config, world, "ddp", 1.0, *sets)
    assert ep == 1 and why.startswith(reason), why


def test_auto_loads_and_passes_the_layout_checks_on_any_world(config):
    # 3 ranks: ep 2 would be refused (it does not divide them); auto picks 1 or 3 there.
    prepared = api.prepare_train(str(config), ["scaling.num_workers=3"])
    assert prepared.cfg.strategy.ep == "auto"


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (["strategy.ep=0"], "strategy.ep = 0: a degree from 1 to 1024, or auto"),
        (["strategy.tp=2"], "strategy.tp = 2 with strategy.ep = 'auto': expert parallelism beside tensor"),
        (["strategy.name=auto"], "strategy.name = 'auto' with strategy.ep = 'auto': the memory estimate"),
        (
            ["scaling.min_workers=2", "scaling.num_workers=4"],
            "scaling.num_workers = [2, 4] with strategy.ep = 'auto': elastic runs keep no expert-parallel layout",
        ),
    ],
)
def test_auto_is_refused_beside_what_ep_does_not_combine_with(config, sets, line):
    with pytest.raises(ConfigError) as raised:
        api.prepare_train(str(config), sets)
    assert str(raised.value).splitlines()[0].startswith(line) or line in str(raised.value), str(raised.value)
    assert len(str(raised.value).splitlines()) == 1


def test_a_rehearsal_at_full_size_says_the_degree_the_ranks_would_choose(config, capsys):
    """`raylane check --world 8` plays rank 0 on torch's fake group with the pipeline's ep_plan:
    the layout's why says what `auto` chooses on 8 H100s (ep 1: every expert fits) and on a
    device too small for any degree (the largest of 1, 2 and 4, which divide the 4 experts)."""
    import os

    from raylane.cli import main

    here = os.getcwd()
    os.chdir(config.parent)
    try:
        lines = {}
        for budget in ("", "0.00001"):
            sets = ["--set", f"scaling.device_memory_gb={budget}"] if budget else []
            code = main(["check", config.name, "--world", "8", *sets])
            out = capsys.readouterr().out
            assert code in (0, None), out
            lines[budget] = next(line.strip() for line in out.splitlines() if line.strip().startswith("why:"))
    finally:
        os.chdir(here)
    assert lines[""].startswith("why: strategy.name: ddp; strategy.ep: auto → 1: DDP needs ~") and lines[""].endswith(
        "KiB per rank at ep 1, of 80.0 GiB per device (85% usable)"
    ), lines
    assert "strategy.ep: auto → 4: DDP needs ~" in lines["0.00001"] and lines["0.00001"].endswith(
        "none of ep 1, 2, 4 fits: the largest"
    ), lines


@pytest.mark.parametrize(
    ("plan", "line"),
    [
        ("no_module", "strategy.ep = 'auto': Pipeline.ep_plan: 'layers.*.moe.expert' names no module of TinyMoE"),
        ("router", "strategy.ep = 'auto': Pipeline.ep_plan: layers.0.moe.router (Linear) is not an experts"),
    ],
)
def test_a_plan_naming_no_experts_module_is_refused_before_launch_under_auto_too(config, plan, line):
    """A misspelt plan is a mistake at any degree: refused before any worker starts, not left
    for the ranks to take as a model without experts (ep 1)."""
    with pytest.raises(ConfigError) as raised:
        api.prepare_train(str(config), [f"model.plan={plan}"])
    assert str(raised.value).startswith(line), str(raised.value)
    assert len(str(raised.value).splitlines()) == 1


def test_no_plan_under_auto_passes_the_checks_and_the_ranks_take_1(config):
    assert api.prepare_train(str(config), ["model.plan=none"]).cfg.strategy.ep == "auto"
