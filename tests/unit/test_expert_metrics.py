"""What a run with expert parallelism shows, and its capacity (issue 65 §2, §5), in one process:
the window's figures from given counts (raylane.loop.observe.experts.load_figures); a capacity's
drops (raylane.loop.distributed.expert_parallel, strategy.ep_capacity_factor) on a one-rank gloo
group, the kept pairs exactly the model's own math; a tiny Mixtral with its router collapsed,
through the loop's own window (MetricsWindow: train/experts/*, its aux_loss) and the run's summary
line; the config's refusals. Two ranks under torchrun: tests/e2e/test_expert_parallel.py."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raylane import api
from raylane.errors import ConfigError
from raylane.loop.distributed import expert_parallel as ep
from raylane.loop.protocols.batches import Forward
from raylane.loop.steps import MetricsWindow, Throughput
from raylane.results import Experts, TrainSummary
from raylane.tracking.progress import experts_text
from tests.conftest import REPO
from tests.helpers.ep_ranks import EXPERTS, tiny_moe
from tests.unit.test_expert_parallel import OwnExperts

pytest.importorskip("transformers")


@pytest.fixture
def one_rank():
    """A one-rank gloo group and a 1-D ep mesh over it, left when the test ends."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))["ep"]
    finally:
        dist.destroy_process_group()


def test_the_window_figures_from_given_counts():
    """Min and max over every module's experts; the imbalance the worst module's max over its
    mean (a collapsed layer is not hidden by a balanced one); E when every pair goes to one expert;
    no imbalance when nothing was routed."""
    from raylane.loop.observe.experts import load_figures

    balanced, skewed = [10, 10, 10, 10], [25, 5, 5, 5]
    assert load_figures([balanced, skewed], 3) == {
        "tokens_min": 5.0,
        "tokens_max": 25.0,
        "imbalance": 2.5,  # 25 over skewed's mean 10; pooled over both layers it would be 1.25
        "dropped_tokens": 3.0,
    }
    assert load_figures([[0, 40, 0, 0]], 0)["imbalance"] == 4.0
    assert load_figures([[0, 0], [0, 0]], 0) == {"tokens_min": 0.0, "tokens_max": 0.0, "dropped_tokens": 0.0}


def _laid(mesh, factor):
    torch.manual_seed(0)
    whole = OwnExperts()
    holder = nn.Module()
    holder.experts = copy.deepcopy(whole)
    ep.apply_expert_parallel(holder, ["experts"], mesh, capacity_factor=factor)
    return whole, holder


def test_a_capacity_drops_each_experts_later_pairs_and_leaves_the_kept_ones_exact(one_rank):
    """10 tokens, top-2, 4 experts, factor 1: each expert takes ceil(20 / 4) = 5 pairs. Seven
    tokens choose experts 0 and 1: each keeps its first 5 (the batch's order) and drops 2. The
    output is the module's own with the dropped pairs' weights 0, to float rounding; the dropped
    weights get no gradient, the kept ones and the experts the module's own. The load counts what
    the router chose, dropped pairs too. A factor that caps nothing is the uncapped path exactly."""
    whole, holder = _laid(one_rank, 1.0)
    index = torch.tensor([[0, 1]] * 7 + [[2, 3]] * 3)
    x, weights = torch.randn(10, 8), torch.rand(10, 2, requires_grad=True)
    got = holder.experts(x, index, weights)
    kept = torch.ones(10, 2)
    kept[5:7] = 0  # tokens 5 and 6: each expert's 6th and 7th pair
    ref_weights = weights.detach().clone().requires_grad_(True)
    want = whole(x, index, ref_weights * kept)
    assert (got - want).abs().max().item() <= 1e-6
    got.square().sum().backward()
    want.square().sum().backward()
    assert torch.equal(weights.grad[5:7], torch.zeros(2, 2))
    assert (weights.grad - ref_weights.grad).abs().max().item() <= 1e-5
    for name in ("w1", "w2", "w3"):
        grad = getattr(holder.experts, name).grad.full_tensor()
        assert (grad - getattr(whole, name).grad).abs().max().item() <= 1e-5, name
    assert ep.expert_drops(holder, reset=True)["experts"].item() == 4
    assert ep.expert_load(holder)["experts"].tolist() == [7, 7, 3, 3]
    assert ep.dispatch_seconds(reset=True) > 0  # timed on CPU
    _, loose = _laid(one_rank, 2.0)  # 10 a expert: none dropped
    _, uncapped = _laid(one_rank, None)
    assert torch.equal(loose.experts(x, index, weights), uncapped.experts(x, index, weights))
    assert ep.expert_drops(loose)["experts"].item() == 0


def _collapsed(mesh, factor):
    """A tiny Mixtral whose routers' weights are zero: every logit equal, torch.topk's ties go to
    experts 2 and 3 for every token (tests/helpers/ep_ranks.py), its aux loss reported."""
    model = tiny_moe("mixtral")
    model.config.output_router_logits = True
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.data.zero_()
    ep.apply_expert_parallel(model, [EXPERTS], mesh, capacity_factor=factor)
    return model


def test_a_collapsed_router_in_the_loops_window_and_the_runs_summary(one_rank):
    """Through the loop's own window (MetricsWindow over the model, the Forward that trains it): 2
    steps of 4 x 8 tokens, top-2, every pair to experts 2 and 3 of 4, capacity factor 1 (16 pairs
    an expert a forward): experts 0 and 1 get none, 2 and 3 32 each in a forward, the imbalance is
    32 over 16, 2.0; 16 pairs dropped an expert, 32 a layer, 64 a forward of 2 layers. The
    model's aux_loss is a step metric. An evaluation's forward counts nothing; the window resets;
    the run's summary sums the windows, and says so in one line."""
    model = _collapsed(one_rank, 1.0)
    forward = Forward(None, None, torch.device("cpu"))
    window = MetricsWindow(torch.device("cpu"), model)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        loss, metrics = forward.run(model, {"input_ids": ids, "labels": ids})
        loss.backward()
        window.step_metrics.add(metrics)
        window.add(loss.detach())
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    got = window.metrics(8, 1e-3, Throughput(), world_size=1)
    assert {k: v for k, v in got.items() if k.startswith("experts/") and k != "experts/all_to_all_share"} == {
        "experts/tokens_min": 0.0,
        "experts/tokens_max": 64.0,  # 2 forwards of 32
        "experts/imbalance": 2.0,
        "experts/dropped_tokens": 128.0,
    }
    assert 0 < got["experts/all_to_all_share"] <= 1
    assert got["aux_loss"] > 0
    window.reset()
    assert all(t.sum() == 0 for t in ep.expert_load(model).values())
    forward.run(model, {"input_ids": ids, "labels": ids})[0].backward()
    summary = window.run_experts()
    assert summary == {
        "modules": 2,
        "experts": 4,
        "ep": 1,
        "capacity_factor": 1.0,
        "routed": 3 * 2 * 64,  # 3 forwards, 2 layers, 32 tokens x 2
        "tokens_min": 0,
        "tokens_max": 96,
        "imbalance": 2.0,
        "dropped": 3 * 2 * 32,
    }
    experts = TrainSummary(status="FINISHED", run_name="r", experts=summary).experts
    assert experts_text(experts) == (
        "2 modules x 4 experts, ep1; tokens per expert min 0 max 96 (imbalance 2.00x), 192 of 384 dropped at "
        "capacity factor 1"
    )


def test_the_summary_line_without_a_capacity():
    experts = Experts(
        modules=48, experts=64, ep=8, routed=4096, tokens_min=1, tokens_max=1234, imbalance=3.5, dropped=0
    )
    line = experts_text(experts)
    assert (
        line
        == "48 modules x 64 experts, ep8; tokens per expert min 1 max 1,234 (imbalance 3.50x), 0 dropped (no capacity)"
    )


def test_a_dense_model_has_no_expert_figures_and_a_plain_output_no_aux_loss():
    window = MetricsWindow(torch.device("cpu"), nn.Linear(2, 2))
    assert window.experts is None and window.run_experts() is None
    forward = Forward(None, None, torch.device("cpu"))
    _, metrics = forward.run(lambda x: (x**2).sum(), torch.ones(3, requires_grad=True))
    assert metrics is None


@pytest.fixture
def config(tmp_path):
    shutil.copy(REPO / "tests" / "helpers" / "moe_own.py", tmp_path / "moe_own.py")
    (tmp_path / "train.yaml").write_text(
        f"pipeline: ./moe_own.py\nscaling:\n  num_workers: 2\nmlflow:\n  enabled: false\n"
        f"run:\n  storage_path: {tmp_path / 'runs'}\n"
    )
    return tmp_path / "train.yaml"


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            ["strategy.ep=2", "strategy.ep_capacity_factor=0"],
            "strategy.ep_capacity_factor = 0: Input should be greater",
        ),
        (["strategy.ep=2", "strategy.ep_capacity_factor=-1.5"], "strategy.ep_capacity_factor = -1.5: Input should be"),
        (
            ["strategy.ep_capacity_factor=1.25"],
            "strategy.ep_capacity_factor = 1.25 with strategy.ep = 1: the capacity caps the tokens expert "
            "parallelism sends to each expert; set strategy.ep > 1, or remove it",
        ),
    ],
)
def test_a_capacity_that_is_not_positive_or_has_no_dispatch_is_refused_in_one_line(config, sets, line):
    with pytest.raises(ConfigError) as raised:
        api.prepare_train(str(config), sets)
    said = str(raised.value)
    assert len(said.splitlines()) == 1 and line in said, said
    api.prepare_train(str(config), ["strategy.ep=2", "strategy.ep_capacity_factor=1.25"])
