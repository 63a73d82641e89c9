"""A user's own mixture-of-experts pipeline, written the torchtitan way: a tiny decoder whose
blocks each hold a router (top-k of a softmax) and an experts module whose weights lead with the
number of experts (`w_in [E, H, I]`, `w_out [E, I, H]`) and whose forward is `experts(hidden
[T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`, the contract Pipeline.ep_plan names.
Its data are token sequences made in build().

`model.plan`: `good` (`layers.*.moe.experts`), `callable` (the same from a function of the model),
`none` (no ep_plan), `no_module` (`layers.*.moe.expert`, misspelt), `router` (the router, a Linear
whose weight also leads with E), `block` (the whole MoE block); `model.experts`, `model.layers`;
`model.declares`: what the Config's gives_ep_plan says (null: nothing, found on the model);
`model.bias_router`: a fixed bias on the router's logits (+8 on expert 0, +4 on expert 1) that
sends every token to experts 0 and 1, the first rank's at ep 2: the other rank receives none."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import raylane

WIDTH, HIDDEN, LENGTH, VOCAB, TOP_K = 16, 8, 8, 32, 2
PLANS = {
    "good": ["layers.*.moe.experts"],
    "no_module": ["layers.*.moe.expert"],
    "router": ["layers.*.moe.router"],
    "block": ["layers.*.moe"],
}


class Model(raylane.Section):
    plan: str = "good"
    experts: int = 4
    layers: int = 2
    declares: bool | None = None
    bias_router: bool = False


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self) -> tuple[str, ...]:
        return ("loss",)

    def gives_ep_plan(self) -> bool | None:
        return self.model.declares


class Experts(nn.Module):
    """Every expert's two projections in one tensor each, the experts leading."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, WIDTH, HIDDEN) * 0.1)
        self.w_out = nn.Parameter(torch.randn(experts, HIDDEN, WIDTH) * 0.1)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            y = F.silu(hidden[token] @ self.w_in[e]) @ self.w_out[e]
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class MoE(nn.Module):
    def __init__(self, experts: int, biased: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, experts, bias=False)
        self.experts = Experts(experts)
        # Not a parameter and not saved: the imbalance is the model's fixed design, not learnt.
        tilt = torch.tensor([8.0, 4.0] + [0.0] * (experts - 2)) if biased else None
        self.register_buffer("tilt", tilt, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.reshape(-1, WIDTH)
        logits = self.router(hidden) if self.tilt is None else self.router(hidden) + self.tilt
        weights, index = logits.softmax(-1).topk(TOP_K, dim=-1)
        return self.experts(hidden, index, weights).view_as(x)


class Block(nn.Module):
    def __init__(self, experts: int, biased: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.moe = MoE(experts, biased)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class TinyMoE(nn.Module):
    def __init__(self, m: Model) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(m.experts, m.bias_router) for _ in range(m.layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def experts_of(model: nn.Module) -> list[str]:
    """An ep_plan given as a function of the model."""
    return [f"layers.{i}.moe.experts" for i in range(len(model.layers))]


def build(cfg: Config) -> raylane.Pipeline:
    m = cfg.model
    tokens = torch.randint(0, VOCAB, (64, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    plan = {"none": None, "callable": experts_of}.get(m.plan, PLANS.get(m.plan))

    def loss_fn(out, target):
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    return raylane.Pipeline(
        model=TinyMoE(m),
        train_set=TensorDataset(tokens[:, :-1], tokens[:, 1:]),
        loss_fn=loss_fn,
        example_input=tokens[:2, :-1],
        ep_plan=plan,
    )
