"""Expert parallelism's pieces in one process (raylane.loop.distributed.expert_parallel): the
pairs' bookkeeping, the layout on a one-rank gloo group (the model itself, to float rounding)
and on torch's `fake` groups (rank 1 of 2: its rows, its local math with a user's
torchtitan-style experts; the meta device; a size that does not divide), the names a plan
gives, the gradients' scale. Two ranks against one process: tests/e2e/test_expert_parallel.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raylane.loop.distributed import expert_parallel as ep
from tests.helpers.ep_ranks import EXPERTS, routed_counts, tiny_moe

pytest.importorskip("transformers")


@pytest.fixture
def fake_rank():
    """fake_rank(rank, size): this process as `rank` of a world of `size` on torch's fake backend
    (nothing is sent), and a 1-D mesh over it; left when the test ends."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make(rank: int, size: int):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
        return init_device_mesh("cpu", (size,), mesh_dim_names=("ep",))["ep"]

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


class OwnExperts(nn.Module):
    """A user's experts written the torchtitan way (SwiGLU, weights (E, in, out)), with the
    fused contract's forward: a different parameter layout and math from transformers'."""

    def __init__(self, experts: int = 4, hidden: int = 8, inner: int = 6) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, hidden, inner) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, inner, hidden) / inner**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, inner) / hidden**0.5)

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            h = torch.nn.functional.silu(x[token] @ self.w1[e]) * (x[token] @ self.w3[e])
            out = out.index_add(0, token, (h @ self.w2[e]) * top_k_weights[token, slot, None])
        return out


def test_pairs_are_sorted_by_expert_counted_and_put_back():
    index = torch.tensor([[3, 0], [1, 3], [0, 2], [3, 1], [2, 0]])
    order, counts = ep.sort_pairs(index, 5)
    ids = index.reshape(-1)
    assert ids[order].tolist() == sorted(ids.tolist())
    assert order.tolist() == sorted(range(10), key=lambda i: (ids[i].item(), i))  # stable
    assert counts.tolist() == [3, 2, 2, 3, 0]  # expert 4: none
    rows = torch.randn(10, 3)
    assert torch.equal(ep.unsort(rows[order], order), rows)
    # What arrives on a rank with 3 local experts, from 2 sources: source 0 sends [1, 0, 2]
    # rows to them, source 1 [0, 3, 1], in that order.
    arrived = ep.arrived_expert_ids(torch.tensor([1, 0, 2, 0, 3, 1]), ep=2, total=7)
    assert arrived.tolist() == [0, 2, 2, 1, 1, 1, 2]


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_ep_over_one_rank_is_the_model_itself(one_rank, family):
    """The whole path (counts swapped, rows sent there and back, the module's own forward on its
    shards, the weights applied after) on a one-rank group: the same logits and gradients, the
    router's included (within 1e-6: measured 1.5e-8, not bitwise, as each expert's matmul takes
    its rows in another order; bitwise with transformers' batched_mm), the same names in the
    state dict, the tokens per expert the model routed (Qwen2-MoE's grouped matmul, Mixtral's
    eager loop)."""
    from torch.distributed.device_mesh import init_device_mesh

    plain, laid = tiny_moe(family), tiny_moe(family)
    keys = list(laid.state_dict())
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))["ep"]
    assert ep.apply_expert_parallel(laid, [EXPERTS], mesh) == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]
    assert list(laid.state_dict()) == keys
    counts = routed_counts(plain)
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(0))
    a, b = plain(input_ids=ids, labels=ids), laid(input_ids=ids, labels=ids)
    assert (a.logits - b.logits).abs().max().item() <= 1e-6
    a.loss.backward()
    b.loss.backward()
    grads = dict(laid.named_parameters())
    for name, p in plain.named_parameters():
        got = grads[name].grad
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert (got - p.grad).abs().max().item() <= 1e-6, name
    assert [c.tolist() for c in counts] == [t.tolist() for t in ep.expert_load(laid, reset=True).values()]
    assert all(t.sum() == 0 for t in ep.expert_load(laid).values())  # reset


def test_own_experts_on_rank_1_of_2_compute_their_experts_with_their_rows(fake_rank):
    """Rank 1 of 2 keeps experts 2 and 3 (its own copy, half the bytes) and its local forward
    computes, for rows sent to local experts 0 and 1, what the whole module computes for experts
    2 and 3 with weight 1: the module's math on the right shards, `num_experts` made 2."""
    mesh = fake_rank(1, 2)
    torch.manual_seed(0)
    whole = OwnExperts()
    mine = copy.deepcopy(whole)
    holder = nn.Module()
    holder.experts = mine
    ep.apply_expert_parallel(holder, ["experts"], mesh)
    w1 = mine.w1.to_local()
    assert torch.equal(w1, whole.w1.detach()[2:])
    assert w1.untyped_storage().nbytes() == whole.w1.untyped_storage().nbytes() // 2  # not a view
    rows, local = torch.randn(5, 8), torch.tensor([1, 0, 1, 1, 0])
    got = mine.run_local(rows, local)
    want = whole(rows, (local + 2).unsqueeze(1), torch.ones(5, 1))
    assert (got - want).abs().max().item() <= 1e-6
    got.sum().backward()
    assert mine.w1.grad.to_local().shape == (2, 8, 6)


def test_a_transformers_model_on_the_meta_device_is_laid_out_in_shapes(fake_rank):
    mesh = fake_rank(0, 2)
    with torch.device("meta"):
        model = tiny_moe("qwen2_moe")
    ep.apply_expert_parallel(model, [EXPERTS], mesh)
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (4, 32, 32) and experts.gate_up_proj.is_meta
    assert experts.gate_up_proj.to_local().shape == (2, 32, 32)
    assert ep.expert_parameter_names(model) == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")
    ]


def test_a_size_that_does_not_divide_the_experts_is_refused_before_anything_changes(fake_rank):
    mesh = fake_rank(0, 3)
    model = tiny_moe("mixtral")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts has 4 experts, which ep 3 does not divide"):
        ep.apply_expert_parallel(model, [EXPERTS], mesh)
    assert not any(hasattr(p, "to_local") for p in model.parameters())
    assert not ep.expert_parallel_modules(model)


def test_a_parameter_without_the_expert_dimension_is_named(fake_rank):
    mesh = fake_rank(0, 2)
    holder = nn.Module()
    holder.experts = OwnExperts()
    holder.experts.scale = nn.Parameter(torch.ones(8))
    with pytest.raises(ValueError, match=r"experts.scale has shape \(8,\), not the number of experts \(4\) leading"):
        ep.apply_expert_parallel(holder, ["experts"], mesh)


def test_names_with_a_wildcard_and_a_name_that_matches_nothing():
    model = tiny_moe("qwen2_moe")
    assert ep.match_modules(model, ["model.layers.*.mlp.experts", "model.layers.0.mlp.experts"]) == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]
    with pytest.raises(ValueError, match=r"'model.layers.\*.mlp.expert' names no module of Qwen2MoeForCausalLM"):
        ep.match_modules(model, ["model.layers.*.mlp.experts", "model.layers.*.mlp.expert"])


def test_expert_gradients_scaled_and_divided(one_rank):
    """reduce_expert_grads without a group (ep is the whole data-parallel world) divides by the
    data-parallel ranks; the dense gradients are left to DDP or FSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    model = tiny_moe("mixtral")
    ep.apply_expert_parallel(model, [EXPERTS], init_device_mesh("cpu", (1,)))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    ep.scale_expert_grads(model, 6.0)
    ep.reduce_expert_grads(model, 3, group=dist.group.WORLD)
    experts = set(ep.expert_parameter_names(model))
    for name, p in model.named_parameters():
        grad = p.grad.to_local() if name in experts else p.grad
        assert grad.unique().tolist() == ([2.0] if name in experts else [1.0]), name
