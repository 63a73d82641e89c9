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

from raylane.loop.data import data_ranks
from raylane.loop.sharding import Strategy
from raylane.loop.steps import clip_gradients
from raylane.loop.tensor_parallel import apply_plan, plan_for


@pytest.fixture
def one_rank():
    """A one-rank gloo group, left when the test ends."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


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
    assert set(plan_for(Tied(), lambda model, sp: _plan(), sequence_parallel=True)) == set(_plan())


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
    assert Strategy("fsdp", (1, 1, 1, 1, 2), tp=2).label == "tp2"  # (pp, dp_replicate, dp_shard, cp, tp)
    assert Strategy("fsdp", (1, 1, 2, 1, 2), tp=2, sequence_parallel=True).label == "fsdp×tp2+sp"
    assert Strategy("ddp", (2,)).label == "ddp"
    tags = Strategy("fsdp", (1, 1, 2, 1, 2), tp=2).tags()
    assert tags["raylane.strategy"] == "fsdp×tp2" and tags["raylane.strategy.mesh"] == "dp_shard 2, tp 2"

    class Runtime:
        rank, world_size = 3, 4

    data = data_ranks(Runtime(), 2)
    assert (data.rank, data.world_size) == (1, 2)  # ranks 2 and 3 are one group, reading one share
    assert data_ranks(Runtime(), 1) is not data  # tp 1: the runtime itself
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
