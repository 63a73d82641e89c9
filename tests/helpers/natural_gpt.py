"""A user's own decoder written the natural way (nanoGPT's shape): the model's forward reads
`B, T = idx.shape` and adds a position embedding of `torch.arange(T)`; each attention views its
q, k and v as `(B, T, self.n_heads, self.head_dim)`; the plan is a dict of torch's styles. Used
as a pipeline file (`pipeline: tests/helpers/natural_gpt.py`) by tests/e2e/test_natural_forwards.py
and imported by the unit tests. `model.head_dim_from_input`: the head size worked out in the forward
from the input's width (`C // self.n_heads`, nanoGPT's own line), which no rank's share of the
heads can satisfy under tensor parallelism."""

from __future__ import annotations

from pydantic import Field

import raylane


class ModelSection(raylane.Section):
    vocab_size: int = Field(64, ge=2)
    block_size: int = Field(16, ge=2)
    n_embd: int = Field(32, ge=1)
    n_heads: int = Field(4, ge=1)
    n_layer: int = Field(2, ge=1)
    tie: bool = False
    head_dim_from_input: bool = False
    samples: int = Field(96, ge=8)


class Config(raylane.BaseConfig):
    model: ModelSection = ModelSection()

    def gives_tp_plan(self) -> bool:
        return True

    def gives_pp_stages(self) -> bool:
        return True


def build_model(m: ModelSection):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_heads = m.n_heads
            self.head_dim = m.n_embd // m.n_heads
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(m.n_embd, m.n_embd) for _ in range(3))
            self.out_proj = nn.Linear(m.n_embd, m.n_embd)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, T, C = x.shape  # noqa: N806 - nanoGPT's names
            hd = C // self.n_heads if m.head_dim_from_input else self.head_dim
            q = self.q_proj(x).view(B, T, self.n_heads, hd).transpose(1, 2)
            k = self.k_proj(x).view(B, T, self.n_heads, hd).transpose(1, 2)
            v = self.v_proj(x).view(B, T, self.n_heads, hd).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * hd))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(m.n_embd)
            self.attn = Attention()
            self.ln_2 = nn.LayerNorm(m.n_embd)
            self.mlp = nn.Sequential(nn.Linear(m.n_embd, 4 * m.n_embd), nn.GELU(), nn.Linear(4 * m.n_embd, m.n_embd))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(m.vocab_size, m.n_embd)
            self.wpe = nn.Embedding(m.block_size, m.n_embd)
            self.blocks = nn.ModuleList(Block() for _ in range(m.n_layer))
            self.ln_f = nn.LayerNorm(m.n_embd)
            self.lm_head = nn.Linear(m.n_embd, m.vocab_size, bias=False)
            if m.tie:
                self.lm_head.weight = self.wte.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            B, T = idx.shape  # noqa: N806
            pos = torch.arange(T, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.blocks:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return TinyLM()


def tp_plan() -> dict:
    """Megatron's split as a dict: q, k, v and the MLP's first layer by columns, their outputs by
    rows, the head by vocabulary columns gathered."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "blocks.*.attn.q_proj": ColwiseParallel(),
        "blocks.*.attn.k_proj": ColwiseParallel(),
        "blocks.*.attn.v_proj": ColwiseParallel(),
        "blocks.*.attn.out_proj": RowwiseParallel(),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def build(cfg: Config) -> raylane.Pipeline:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    m = cfg.model
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(m.vocab_size, (m.samples, m.block_size + 1), generator=gen)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    held = m.samples // 4

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    return raylane.Pipeline(
        model=build_model(m),
        train_set=torch.utils.data.Subset(data, range(held, m.samples)),
        eval_set=torch.utils.data.Subset(data, range(held)),
        loss_fn=loss_fn,
        tp_plan=tp_plan(),
        pp_stages="auto",
        example_input=tokens[:2, :-1],
    )
