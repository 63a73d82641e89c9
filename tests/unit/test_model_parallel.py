"""Model parallelism's choices and traps in one process: `strategy.tp: auto` on a fake process
group of 8 ranks (torch's `fake` backend: real meshes, real FSDP2 and plans, nothing sent), the
optimizer built over FSDP2's shards after a forward without backward (trap c), loss parallelism's
split head, the layout's name, and context parallelism refused before launch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raylane.config import load_config
from raylane.errors import ConfigError
from raylane.loop.data.loader import first_batch
from raylane.loop.distributed.auto import parameter_bytes
from raylane.loop.distributed.fsdp import Strategy, resharded
from raylane.loop.distributed.layout import Layout
from raylane.loop.distributed.parallelize import parallelize
from raylane.loop.distributed.tensor_parallel import plan_for, with_split_head

GIB = 1024**3


@pytest.fixture
def eight_fake_ranks(monkeypatch):
    """This process as rank 0 of 8 on one node, over torch's fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _gpt(*sets: str):
    from raylane.pipelines.gpt import build

    cfg = load_config("gpt-tiny", ["model.n_head=8", "model.n_layer=2", *sets])
    return cfg, build(cfg)


def _choose(cfg, pipe):
    model, strategy = parallelize(
        pipe.model,
        cfg,
        torch.device("cpu"),
        8,
        example=first_batch(pipe.train_set, cfg.train.batch_size),
        loss_fn=pipe.loss_fn,
        blocks=pipe.blocks,
        tp_plan=pipe.tp_plan,
    )
    return strategy


def test_tp_auto_measures_each_layout_and_adds_tp_only_when_fsdp_does_not_fit(eight_fake_ranks):
    """The per-rank bytes are measured by laying the meta model out for real: FSDP over 8 ranks
    holds rank 0's row chunk of every parameter, exactly; with sequence parallelism each tp
    divides the activations and the gathered blocks, so the estimate falls as tp grows. Under a
    budget FSDP fits, FSDP is chosen; under one only tp 2 fits, tp 2; under one tp 4 fits, tp 4;
    under none, the smallest. Planted: the candidates tried in any other order (the largest tp
    first) picks tp 8 under every budget."""
    sets = ("strategy.name=fsdp", "strategy.tp=auto", "strategy.sequence_parallel=true")
    cfg, pipe = _gpt(*sets, "scaling.device_memory_gb=1000")
    with torch.device("meta"):
        meta = type(pipe.model)()
    chunks = sum(math.ceil(p.shape[0] / 8) * p[0].numel() * 4 for p in meta.parameters())
    assert parameter_bytes(meta, None, Layout("fsdp", dp_shard=8), None) == chunks
    assert (
        parameter_bytes(meta, None, Layout("fsdp", tp=8, sequence_parallel=True), pipe.tp_plan) > chunks
    )  # norms whole

    big = _choose(cfg, pipe)
    assert (big.label, big.tp, big.mesh_shape) == ("fsdp", 1, (8,))
    e = big.estimate
    assert e["fsdp"] > e["fsdp_tp2"] > e["fsdp_tp4"] > e["fsdp_tp8"], e
    assert "tp auto: per rank FSDP ~" in big.reason and "FSDP×TP8" in big.reason
    for need, label, tp in ((e["fsdp_tp2"], "fsdp×tp2+sp", 2), (e["fsdp_tp4"], "fsdp×tp4+sp", 4)):
        budget = (need + 1) / 0.85 / GIB  # fits this layout, not the one before it
        cfg, pipe = _gpt(*sets, f"scaling.device_memory_gb={budget}")
        chosen = _choose(cfg, pipe)
        assert (chosen.label, chosen.tp, chosen.mesh_shape) == (label, tp, (1, 1, 8 // tp, 1, tp)), chosen.reason
    cfg, pipe = _gpt(*sets, "scaling.device_memory_gb=1e-6")
    tiny = _choose(cfg, pipe)
    assert tiny.tp == 8 and tiny.reason.endswith("none fits: the smallest")


def test_tp_auto_tries_only_the_degrees_the_model_allows(eight_fake_ranks):
    """gpt-tiny's 2 heads split over 2 ranks, not 4 or 8: only tp 2 is weighed."""
    from raylane.pipelines.gpt import build

    cfg = load_config("gpt-tiny", ["strategy.name=fsdp", "strategy.tp=auto", "scaling.device_memory_gb=1000"])
    strategy = _choose(cfg, build(cfg))
    assert {k for k in strategy.estimate if k.startswith("fsdp")} == {"fsdp", "fsdp_tp2"}


def test_tp_auto_weighs_no_degree_when_the_config_fails_its_checks_here(monkeypatch, caplog):
    """The degrees come from the config's own checks at each degree (gpt's 8 heads: 2, 4 and 8 of
    8 ranks on a node of 8; 2 and 4 on a node of 4); where the checks fail at tp 1 too (whatever
    the reason on this host), they tell nothing: no degree is weighed, and it says why."""
    from raylane.loop.distributed.auto import tp_candidates

    cfg = load_config("gpt-tiny", ["model.n_head=8", "strategy.name=fsdp", "strategy.tp=auto"])
    assert tp_candidates(cfg, 8, 8) == [2, 4, 8] and tp_candidates(cfg, 8, 4) == [2, 4]

    def failing(data):
        raise ValueError("no such file")

    monkeypatch.setattr(type(cfg), "model_validate", failing)
    assert tp_candidates(cfg, 8, 8) == []
    assert "strategy.tp: auto tries no tensor parallelism: the config's checks fail here (no such file)" in caplog.text


def test_the_optimizer_holds_the_shards_after_a_forward_without_backward(one_rank):
    """A forward without backward (a pipeline's init_weights checking its weights) leaves FSDP2's
    root unsharded, and an optimizer built then holds the unsharded tensors: the root's weights
    never train (trap c). raylane builds it over `resharded(model)`: every weight moves. Planted:
    without resharded, the head's weight and bias stay as they were after a step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    fully_shard(model[0])
    fully_shard(model, reshard_after_forward=False)  # as raylane shards the root
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model(torch.randn(2, 4))
    optimizer = torch.optim.SGD(resharded(model).parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    unchanged = [n for n, p in model.named_parameters() if torch.equal(p.full_tensor(), before[n])]
    assert unchanged == []


def test_build_trainer_builds_the_optimizer_over_the_shards(one_rank, monkeypatch):
    """The run's own path: build_trainer hands the optimizer the model resharded (a test double
    records what it got)."""
    import raylane.loop.run as run

    seen = []
    monkeypatch.setattr(run, "resharded", lambda model: seen.append(model) or model)
    cfg = load_config("regression", ["mlflow.enabled=false", "train.max_steps=1"])
    from raylane.pipelines.regression import build

    trainer = run.build_trainer(cfg, run.local_runtime(cfg, lambda e: None), build(cfg))
    assert seen == [trainer.model]


def test_loss_parallel_leaves_the_heads_logits_split():
    """The plan's one column-wise rule that gathers its output (gpt's lm_head) keeps its input
    layout and leaves its output split over the vocabulary, as a DTensor; a plan without such a
    head says so."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    cfg, pipe = _gpt()
    rules = with_split_head(plan_for(pipe.model, pipe.tp_plan, sequence_parallel=True))
    head = rules["lm_head"]
    assert (head.input_layouts, head.output_layouts, head.use_local_output) == ((Shard(1),), (Shard(-1),), False)
    assert rules["blocks.*.attn.q_proj"].output_layouts == (Shard(-1),)  # the others as they were
    with pytest.raises(ValueError, match="exactly one head, a ColwiseParallel rule with output_layouts=Replicate"):
        with_split_head(
            {"a": ColwiseParallel(output_layouts=Replicate()), "b": ColwiseParallel(output_layouts=Replicate())}
        )
    with pytest.raises(ValueError, match=r"\(it has none\)"):
        with_split_head({"a": ColwiseParallel(), "c": head})


def test_the_layout_names_every_dimension():
    assert Layout("fsdp", dp_shard=2, tp=2).label() == "fsdp×tp2"
    assert Layout("ddp", dp_replicate=2, tp=2, loss_parallel=True).label() == "ddp×tp2+lp"
    assert Layout("hsdp", pp=2, dp_replicate=2, dp_shard=2, tp=2).label() == "hsdp×tp2×pp2"
    assert Layout("fsdp", pp=2, dp_shard=2, tp=2).mesh_text() == "pp 2, dp_shard 2, tp 2"
    assert Layout("fsdp", tp=2, sequence_parallel=True).label() == "tp2+sp"
    assert Layout("single").label() == "single" and Layout("fsdp", dp_shard=4).mesh_text() == ""
    s = Strategy(Layout("fsdp", dp_shard=2, tp=2, loss_parallel=True))
    assert s.label == "fsdp×tp2+lp" and s.tags()["raylane.strategy.mesh"] == "dp_shard 2, tp 2"
    hsdp, ddp = Layout.data_parallel_of("fsdp", 8, replicas=2), Layout.data_parallel_of("ddp", 4)
    assert Strategy(hsdp).label == "hsdp" and Strategy(ddp).layout.dp_replicate == 4
    sets = ["strategy.name=fsdp", "strategy.pp=2", "strategy.dp_replicate=2", "model.tie_embeddings=false"]
    section = load_config("gpt-tiny", sets).strategy
    assert Layout.model_parallel_of(section, 8).label() == "hsdp×pp2"  # FSDP2 with replicas is HSDP


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["strategy.cp=2"],
            "strategy.cp = 2: context parallelism needs CUDA's SDPA kernels (ring attention), which a CPU run "
            "does not have; use strategy.cp: 1",
        ),
        (["strategy.cp=2", "scaling.use_gpu=true"], "strategy.cp = 2: context parallelism is not built yet"),
        (["strategy.loss_parallel=true"], "strategy.loss_parallel = True needs strategy.tp > 1"),
        (["strategy.tp=auto"], "strategy.name = 'ddp' with strategy.tp = 'auto': replicas of a tensor-parallel"),
        (
            ["strategy.tp=auto", "strategy.name=fsdp", "train.global_batch=64"],
            "train.global_batch = 64 with strategy.tp = 'auto'",
        ),
        (["strategy.tp=0"], "strategy.tp = 0: a degree from 1 to 1024, or auto"),
    ],
)
def test_layouts_refused_by_the_config(sets, message):
    with pytest.raises(ConfigError) as caught:
        load_config("gpt-tiny", sets)
    assert message in str(caught.value) and "\n" not in str(caught.value).strip(), str(caught.value)


def test_the_estimate_shows_small_sizes_apart(eight_fake_ranks):
    """Each candidate's bytes in a unit that tells them apart: before, a small model's line read
    `FSDP ~0.01 GiB, FSDP×TP2 ~0.01 GiB, ... of 0.01 GiB per device` (2 decimals of a GiB)."""
    import re

    from raylane.loop.distributed.devices import size_text

    sets = ("strategy.name=fsdp", "strategy.tp=auto", "strategy.sequence_parallel=true")
    cfg, pipe = _gpt(*sets, "scaling.device_memory_gb=0.0076")
    chosen = _choose(cfg, pipe)
    reason, estimate = chosen.reason, chosen.estimate
    shown = dict(re.findall(r"(FSDP(?:×TP\d)?) ~([\d.]+ [KMG]iB)", reason))
    assert list(shown) == ["FSDP", "FSDP×TP2", "FSDP×TP4", "FSDP×TP8"], reason
    assert all(size.endswith("MiB") for size in shown.values()), reason
    need = {k: estimate[k.lower().replace("×", "_")] for k in shown}
    for a in shown:  # sizes 1% apart read apart (3 significant figures)
        for b in shown:
            if abs(need[a] - need[b]) > 0.01 * max(need[a], need[b]):
                assert shown[a] != shown[b], reason
    assert len(set(shown.values())) > 1, reason
    assert "of 7.78 MiB per device (85% usable)" in reason
    assert [size_text(n) for n in (0, 1536, 7_654_321, 0.0076 * GIB, 1.5 * GIB, 80 * GIB)] == [
        "0 B",
        "1.50 KiB",
        "7.30 MiB",
        "7.78 MiB",
        "1.50 GiB",
        "80.0 GiB",
    ]
    assert size_text(99.99 * 1024) == "100 KiB"  # rounded before the unit's format: not "100."


def test_tp_auto_tries_only_the_degrees_a_users_model_heads_allow(eight_fake_ranks):
    """A user's own model says its heads by an attribute (`n_heads`), not by a config key the
    config's checks read: 4 heads on a node of 8 give tp 2 and 4, not 8; 3 heads none (FSDP).
    Before, tp 8 (or 2 for 3 heads) was weighed and the plan's head count failed on the ranks:
    `strategy.tp = 2: does not divide layers.0.attn.n_heads = 3`."""
    from raylane.loop.usercode import build_pipeline

    for heads, tried in ((4, {"fsdp_tp2", "fsdp_tp4"}), (3, set())):
        sets = ["strategy.name=fsdp", "strategy.tp=auto", "scaling.device_memory_gb=1e-6", f"model.heads={heads}"]
        cfg = load_config({"pipeline": "tests.helpers.plan_mistakes"}, sets)
        chosen = _choose(cfg, build_pipeline(cfg))
        assert {k for k in chosen.estimate if k.startswith("fsdp_tp")} == tried, chosen.reason
