"""A user's own pipeline with each plan and stage mistake of issue 60's finding 2 one config key
away: a tiny decoder (`model.kind: own`: attention modules holding `n_heads`, q/k/v and out
projections, an MLP, blocks in `layers`) or a tiny Hugging Face Llama made from its config in
build() (`model.kind: hf`, transformers' own plan or one in its notation). Its data are token
sequences made in build() whose vocabulary is read from the values (`.item()`), as data code does.

`model.plan`: `objects` (torch's styles), `strings` (`"colwise"`, ... as transformers writes
them), `misspelt` (`"colwize"`), `no_module` (a rule for `layers.*.attn.out_projection`), `conv`
(a rowwise rule on a module no style splits), `hf` (the HF model's own plan); `model.heads`,
`model.layers`, `model.tied` (the head is the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import raylane

WIDTH, LENGTH = 24, 8


class Model(raylane.Section):
    kind: str = "own"
    plan: str = "objects"
    heads: int = 2
    layers: int = 2
    tied: bool = False


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self) -> tuple[str, ...]:
        return ("loss",)

    def gives_tp_plan(self) -> bool:
        return True

    def gives_pp_stages(self) -> bool:
        return True


class Attention(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, WIDTH // heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.attn = Attention(heads)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.conv = nn.Conv1d(LENGTH, LENGTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x))) + 0 * self.conv(x)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, m: Model) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.layers = nn.ModuleList(Block(m.heads) for _ in range(m.layers))
        self.head = nn.Linear(WIDTH, vocab, bias=False)
        if m.tied:
            self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def own_plan(kind: str) -> dict:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if kind in ("strings", "misspelt"):
        col = "colwize" if kind == "misspelt" else "colwise"
        plan = {f"layers.*.attn.{p}": col for p in ("q_proj", "k_proj", "v_proj")}
        plan |= {"layers.*.attn.out_proj": "rowwise", "layers.*.up": "colwise", "layers.*.down": "rowwise"}
        return {**plan, "head": "colwise_rep"}  # the objects' plan, by name
    plan = {f"layers.*.attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
    plan |= {"layers.*.attn.out_proj": RowwiseParallel(), "layers.*.up": ColwiseParallel()}
    plan |= {"layers.*.down": RowwiseParallel(), "head": ColwiseParallel(output_layouts=Replicate())}
    if kind == "no_module":
        plan["layers.*.attn.out_projection"] = plan.pop("layers.*.attn.out_proj")
    if kind == "conv":
        plan["layers.*.conv"] = RowwiseParallel()
    return plan


def hf_model(m: Model, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=m.layers,
        num_attention_heads=m.heads,
        num_key_value_heads=m.heads,
        max_position_embeddings=LENGTH,
        tie_word_embeddings=m.tied,
    )
    return LlamaForCausalLM(config)


def hf_strings(kind: str) -> dict:
    """The Llama's plan in transformers' own notation (its base_model_tp_plan's), or misspelt."""
    col = "colwize" if kind == "misspelt" else "colwise"
    at = "model.layers.*."
    plan = {f"{at}self_attn.{p}": col for p in ("q_proj", "k_proj", "v_proj")}
    plan |= {f"{at}self_attn.o_proj": "rowwise", f"{at}mlp.gate_proj": "colwise", f"{at}mlp.up_proj": "colwise"}
    return {
        **plan,
        f"{at}mlp.down_proj": "rowwise",
        "model.embed_tokens": "embedding_rowwise",
        "lm_head": "colwise_rep",
    }


def build(cfg: Config) -> raylane.Pipeline:
    m = cfg.model
    tokens = torch.randint(0, 32, (64, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    vocab = int(tokens.max().item()) + 1  # data code reads values: no meta tensor has them
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    if m.kind == "hf":
        from raylane.hf.tensor_parallel import tp_plan

        model = hf_model(m, vocab)
        plan = tp_plan if m.plan == "hf" else hf_strings(m.plan)

        def loss_fn(out, target):
            return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())
    else:
        model, plan = TinyLM(vocab, m), own_plan(m.plan)

        def loss_fn(out, target):
            return F.cross_entropy(out.flatten(0, 1), target.flatten())

    def eval_sums(out, target):
        return {"loss": loss_fn(out, target) * len(target)}

    return raylane.Pipeline(
        model=model,
        train_set=data,
        eval_set=TensorDataset(tokens[:16, :-1], tokens[:16, 1:]),
        eval_sums=eval_sums,
        loss_fn=loss_fn,
        example_input=tokens[:2, :-1],
        tp_plan=plan,
        pp_stages="auto",
    )
