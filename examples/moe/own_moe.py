"""Your own mixture of experts under `strategy.ep`: a tiny decoder whose blocks each hold a router
and an experts module written the way torchtitan writes them, and the Pipeline.ep_plan naming
those modules. The data are made here: sequences whose next token is the previous one plus a
step that depends on the sequence's first token, so that different tokens want different experts.

What makes a module an experts module raylane can split (docs/strategies.md, Expert parallelism):
- every expert's weights in its own parameters, the experts leading: `w_in [E, D, F]`,
  `w_out [E, F, D]` (not a ModuleList of one module an expert);
- `forward(hidden [T, D], top_k_index [T, k], top_k_weights [T, k]) -> [T, D]`: the tokens, the
  experts the router chose for each and their weights; the router stays outside, in the block,
  and runs as written. Under ep, raylane calls this forward on each rank with that rank's
  experts and the tokens sent to them.

    torchrun --standalone --nproc_per_node 2 -m raylane train own.yaml   # 2 ranks, 4 experts each
    raylane train own.yaml --local --set strategy.ep=1                    # one process, all 8"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import raylane

VOCAB, LENGTH = 64, 32


class Model(raylane.Section):
    width: int = 64
    expert_width: int = 128
    experts: int = 8
    top_k: int = 2
    layers: int = 2


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self) -> tuple[str, ...]:
        return ("loss",)

    def gives_ep_plan(self) -> bool:
        return True  # raylane need not build the model to know (it checks the plan on a meta copy anyway)


class Experts(nn.Module):
    """E SwiGLU-less two-layer MLPs, their weights stacked along the first dimension."""

    def __init__(self, experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, width, hidden) * width**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, width) * hidden**-0.5)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):  # under ep: this rank's experts only, numbered from 0
            token, slot = torch.where(top_k_index == e)
            y = F.gelu(hidden[token] @ self.w_in[e]) @ self.w_out[e]
            out = out.index_add(0, token, y * top_k_weights[token, slot, None])
        return out


class MoE(nn.Module):
    def __init__(self, m: Model) -> None:
        super().__init__()
        self.top_k = m.top_k
        self.router = nn.Linear(m.width, m.experts, bias=False)
        self.experts = Experts(m.experts, m.width, m.expert_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.reshape(-1, x.shape[-1])
        weights, index = self.router(hidden).softmax(-1).topk(self.top_k, dim=-1)
        return self.experts(hidden, index, weights / weights.sum(-1, keepdim=True)).view_as(x)


class Block(nn.Module):
    def __init__(self, m: Model) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(m.width)
        self.moe = MoE(m)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class TinyMoE(nn.Module):
    def __init__(self, m: Model) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, m.width)
        self.position = nn.Parameter(torch.zeros(LENGTH, m.width))
        self.layers = nn.ModuleList(Block(m) for _ in range(m.layers))
        self.head = nn.Linear(m.width, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.position[: idx.shape[1]]
        for block in self.layers:
            x = block(x)
        return self.head(x)


def sequences(n: int, seed: int = 0) -> torch.Tensor:
    """[n, LENGTH + 1] token ids: each sequence counts up from its first token by a step (1 to 4)
    its first token chooses, modulo VOCAB."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = first % 4 + 1
    return (first + step * torch.arange(LENGTH + 1)) % VOCAB


def build(cfg: Config) -> raylane.Pipeline:
    tokens = sequences(2048)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    return raylane.Pipeline(
        model=TinyMoE(cfg.model),
        train_set=TensorDataset(tokens[:, :-1], tokens[:, 1:]),
        loss_fn=loss_fn,
        example_input=tokens[:2, :-1],
        blocks="layers",
        ep_plan=["layers.*.moe.experts"],  # or a function of the model returning the paths
    )
