"""Tensor parallelism's pieces in one process, on a one-rank gloo group (the meshes are real,
of one rank each): the plan's checks, tied parameters kept tied, gradient clipping over two
meshes, the layout's name, the data split by tensor-parallel group, and the gpt pipeline's
checkpoints from before q, k and v were split. The layouts themselves, on 2 ranks, are
tests/e2e/test_strategies.py's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raylane.loop.data.loader import data_ranks
from raylane.loop.distributed.fsdp import Strategy
from raylane.loop.distributed.layout import Layout
from raylane.loop.distributed.tensor_parallel import apply_plan, plan_for
from raylane.loop.steps import clip_gradients


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


def _plan():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "blocks.*": ColwiseParallel(output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def test_tied_weights_stay_tied_through_the_plan(one_rank):
    """parallelize_module gives the head a Parameter of its own (trap b): the head and the
    embedding are one parameter again after the plan, so one gradient updates both. Planted:
    apply_plan without its retie: `lm_head.weight is wte.weight` fails."""
    from torch.distributed.device_mesh import init_device_mesh

    model = Tied()
    apply_plan(model, _plan(), init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)), sequence_parallel=False)
    assert model.lm_head.weight is model.wte.weight
    assert len(list(model.parameters())) == 1 + 2 * 2


def test_a_rule_that_names_nothing_is_an_error():
    plan = {**_plan(), "blocks.*.attn": object()}
    with pytest.raises(ValueError, match=r"Pipeline.tp_plan: 'blocks.\*.attn' names no module of Tied"):
        plan_for(Tied(), plan, sequence_parallel=False)
    assert set(plan_for(Tied(), lambda model, sp: _plan(), sequence_parallel=False)) == set(_plan())


def test_clipping_over_two_meshes(one_rank):
    """FSDP2 x TP leaves a block's split weights on (dp, tp) and the rest on dp (trap a), and a
    plain replicated parameter may sit beside them: the norm is every gradient's, and clipping
    scales each by the same factor. Planted: the norm of all gradients at once (torch's
    get_total_norm, as before) raises `aten._foreach_norm.Scalar got mixed torch.Tensor and
    DTensor` (without the plain one: `All operands in aten.stack.default must have the same
    mesh`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    flat = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    values = [torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0]), torch.tensor([12.0]), torch.tensor([0.0, 84.0])]
    params = []
    for value, mesh in zip(values, (flat, grid, grid, None), strict=True):
        if mesh is None:  # a plain, replicated parameter beside them
            p = nn.Parameter(torch.zeros_like(value))
            p.grad = value.clone()
        else:
            p = nn.Parameter(distribute_tensor(torch.zeros_like(value), mesh, [Replicate()] * mesh.ndim))
            p.grad = distribute_tensor(value.clone(), mesh, [Replicate()] * mesh.ndim)
        params.append(p)
    norm, finite = clip_gradients(params, 6.5, plain=False)
    assert finite and float(norm) == pytest.approx(85.0)
    clipped = torch.cat([getattr(p.grad, "full_tensor", p.grad.clone)() for p in params])
    assert torch.allclose(clipped, torch.cat(values) * 6.5 / (85.0 + 1e-6))
    params[0].grad = distribute_tensor(torch.tensor([float("nan"), 0.0]), flat, [Replicate()])
    assert clip_gradients(params, None, plain=False)[1] is False  # the NaN check, over both meshes


def test_the_layout_names_itself_and_splits_the_data_by_group():
    assert Strategy(Layout("fsdp", tp=2)).label == "tp2"
    assert Strategy(Layout("fsdp", dp_shard=2, tp=2, sequence_parallel=True)).label == "fsdp×tp2+sp"
    assert Strategy(Layout.data_parallel_of("ddp", 2)).label == "ddp"
    tags = Strategy(Layout("fsdp", dp_shard=2, tp=2)).tags()
    assert tags["raylane.strategy"] == "fsdp×tp2" and tags["raylane.strategy.mesh"] == "dp_shard 2, tp 2"

    class Runtime:
        rank, world_size = 3, 4

    data = data_ranks(Runtime(), Layout("fsdp", dp_shard=2, tp=2))
    assert (data.rank, data.world_size) == (1, 2)  # ranks 2 and 3 are one group, reading one share
    assert data_ranks(Runtime(), Layout.data_parallel_of("fsdp", 4)) is not data  # tp 1: the runtime itself
    assert data.data_stream("train", None, batch_size=1) is None


def test_a_gpt_state_dict_with_the_fused_attention_still_loads():
    """Before tensor parallelism, gpt's attention held q, k and v in one c_attn of 3 x n_embd
    rows: such a state dict (what `raylane export` and MLflow's model load) loads into the split
    q_proj, k_proj and v_proj, row for row."""
    from raylane.config import load_config
    from raylane.pipelines.gpt import build_model

    cfg = load_config("gpt-tiny")
    model = build_model(cfg.model)
    old = {}
    for name, value in model.state_dict().items():
        if ".attn.q_proj." in name:
            parts = [model.state_dict()[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            old[name.replace("q_proj", "c_attn")] = torch.cat(parts)
        elif ".attn.k_proj." not in name and ".attn.v_proj." not in name:
            old[name] = value
    fresh = build_model(cfg.model)
    torch.manual_seed(1)
    fresh.apply(lambda m: nn.init.normal_(m.weight) if isinstance(m, nn.Linear) else None)
    fresh.load_state_dict(old)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def _natural(**fields):
    from tests.helpers.natural_gpt import ModelSection, build_model, tp_plan

    return build_model(ModelSection(**fields)), tp_plan()


def test_a_split_attention_s_head_count_becomes_the_rank_s_own():
    """nanoGPT's attention views q, k and v by `self.n_heads`: after the plan each attention's
    head count is its rank's share (4 heads over 2 ranks: 2), the head size and the blocks'
    other attributes untouched; applied again (a stage's plan after the model's) it stays 2. On a
    rank's share of the plan (a fake world of 2, the meta device) the forward then runs, and its
    output is the whole model's shape. Seen failing before: without local_heads the same forward
    raises `shape '[2, 16, 4, 8]' is invalid for input of size 512` at the view."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from raylane.loop.distributed.tensor_parallel import local_heads

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with torch.device("meta"):
            model, plan = _natural()
        apply_plan(model, plan, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=False)
        attn = model.blocks[1].attn
        assert (attn.n_heads, attn.head_dim) == (2, 8)
        assert local_heads(model, plan, 2) == [] and attn.n_heads == 2
        out = model(torch.zeros(2, 16, dtype=torch.long, device="meta"))
        assert out.shape == (2, 16, 64)
    finally:
        dist.destroy_process_group()


def test_local_heads_refuses_heads_the_degree_does_not_divide():
    from torch.distributed.tensor.parallel import ColwiseParallel

    from raylane.loop.distributed.tensor_parallel import local_heads

    model, _ = _natural(n_heads=2, n_embd=32)
    with pytest.raises(ValueError, match=r"strategy.tp = 4: does not divide blocks.0.attn.n_heads = 2"):
        local_heads(model, {"blocks.*.attn.q_proj": ColwiseParallel()}, 4)


def test_a_forward_no_rank_s_share_can_run_is_refused_before_launch():
    """The forward check runs the model on one rank's share of the plan before launch: nanoGPT's
    own line `C // self.n_heads` (the head size from the input's whole width) fails there, and
    the refusal is one line naming strategy.tp, the attention, the user's file:line, torch's
    error and what the forward must do; the same model with its head size set at init passes."""
    from raylane.loop.distributed.forward_checks import check_tp_forward

    example = torch.zeros(2, 16, dtype=torch.long)
    model, plan = _natural()
    check_tp_forward(model, plan, 2, example)  # passes: head_dim from init, n_heads divided
    assert not dist.is_initialized()
    model, plan = _natural(head_dim_from_input=True)
    with pytest.raises(ValueError) as failed:
        check_tp_forward(model, plan, 2, example)
    line = str(failed.value)
    assert "\n" not in line and not dist.is_initialized()
    assert line.startswith("strategy.tp = 2: TinyLM's forward fails in blocks.0.attn (")
    assert "tests/helpers/natural_gpt.py:" in line and "is invalid for input of size" in line
    assert "view them with -1 heads" in line and "self.head_dim" in line


def test_sequence_parallelism_needs_a_plan_written_for_it():
    """A dict plan lays out nothing more with sequence parallelism, and neither does a function
    that ignores its flag: both are refused in one line naming strategy.sequence_parallel (the run
    was named `tp2+sp` while training as plain tp2). gpt's plan, which lays out its norms and
    residual stream for it, passes."""
    from raylane.loop.distributed.tensor_parallel import check_sequence_parallel
    from raylane.pipelines.gpt import build_model, tp_plan

    model, plan = _natural()
    with pytest.raises(ValueError, match=r"^strategy.sequence_parallel = True: the pipeline's tp_plan is a dict; "):
        plan_for(model, plan, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"tp_plan\(model, sequence_parallel\) gives the same plan either way"):
        plan_for(model, lambda m, sp: plan, sequence_parallel=True)
    assert set(plan_for(model, plan, sequence_parallel=False)) == set(plan)
    from raylane.config import load_config

    gpt = build_model(load_config("gpt-tiny").model)
    check_sequence_parallel(gpt, tp_plan)


@pytest.fixture
def four_fake_ranks(monkeypatch):
    """This process as rank 0 of 4 on one node, over torch's fake backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tp_auto(*sets: str):
    from raylane.config import load_config
    from raylane.loop.data.loader import first_batch
    from raylane.loop.distributed.parallelize import parallelize
    from raylane.pipelines.gpt import build

    cfg = load_config("gpt-tiny", ["model.n_head=4", "strategy.name=fsdp", "strategy.tp=auto", *sets])
    pipe = build(cfg)
    example = first_batch(pipe.train_set, cfg.train.batch_size)
    _, strategy = parallelize(
        pipe.model, cfg, torch.device("cpu"), 4, example=example, loss_fn=pipe.loss_fn, tp_plan=pipe.tp_plan
    )
    return strategy


def test_tp_auto_counts_the_activations_each_layout_keeps_measured(four_fake_ranks):
    """`tp: auto` weighs each tensor-parallel candidate with one rank's activations measured on a
    meta copy with the plan laid out (a fake world of 4): tp2 keeps fewer than one process, sequence
    parallelism fewer again (its norms and residual stream split by tokens), and both more than
    half of one process's (the inputs gathered for each attention and MLP are kept whole). Seen
    failing before: the estimate was the whole model's without sequence parallelism and exactly
    half of it with (gpt-tiny's 4 heads at tp2: 15.7 MB, 7.9 MB with sp; measured 10.3 MB and 9.6 MB)."""
    plain = _tp_auto("scaling.device_memory_gb=1000").estimate
    sp = _tp_auto("scaling.device_memory_gb=1000", "strategy.sequence_parallel=true").estimate
    whole = plain["activations"]
    assert sp["activations"] == whole
    assert whole > plain["activations_tp2"] > sp["activations_tp2"] > whole // 2, (plain, sp)
    assert plain["activations_tp2"] > plain["activations_tp4"] and sp["activations_tp2"] > sp["activations_tp4"]


def test_tp_auto_with_a_dict_plan_and_sequence_parallelism_is_refused(four_fake_ranks):
    """The report's case: a dict plan, `sequence_parallel: true` and `tp: auto`; the plan cannot
    lay sequence parallelism out, so no candidate is weighed as if it did: one line naming
    strategy.sequence_parallel."""
    from raylane.config import load_config
    from raylane.loop.distributed.parallelize import parallelize

    model, plan = _natural()
    cfg = load_config("gpt-tiny", ["strategy.name=fsdp", "strategy.tp=auto", "strategy.sequence_parallel=true"])
    example = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^strategy.sequence_parallel = True: the pipeline's tp_plan is a dict"):
        parallelize(model, cfg, torch.device("cpu"), 4, example=example, loss_fn=None, tp_plan=plan)


def test_styles_given_by_name_are_torch_s_on_the_ranks_and_heads_follow_them():
    """A plan in transformers' notation (`"colwise"`, `"rowwise"`, `"colwise_rep"`) is laid out as
    torch's styles by plan_for, the one path of the ranks, of `tp: auto` and of the checks (before:
    torch's `Expect Union[ParallelStyle, ...] <class 'str'> found!` on the ranks); the attentions'
    head counts follow a named column split as a made one, and the forward runs on a rank's share.
    A misspelt name is one line naming the rule (raylane.loop.distributed.tp_styles)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from raylane.loop.distributed.forward_checks import check_tp_forward

    model, plan = _natural()
    named = {k: "rowwise" if isinstance(v, RowwiseParallel) else "colwise" for k, v in plan.items()}
    named["lm_head"] = "colwise_rep"
    rules = plan_for(model, named, sequence_parallel=False)
    assert isinstance(rules["blocks.*.attn.q_proj"], ColwiseParallel)
    assert isinstance(rules["blocks.*.mlp.2"], RowwiseParallel)
    check_tp_forward(model, named, 2, torch.zeros(2, 16, dtype=torch.long))
    model, _ = _natural(head_dim_from_input=True)
    with pytest.raises(ValueError, match="TinyLM's forward fails in blocks.0.attn"):
        check_tp_forward(model, named, 2, torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"Pipeline.tp_plan\['lm_head'\] = 'colwize_rep'"):
        plan_for(model, {**named, "lm_head": "colwize_rep"}, sequence_parallel=False)
