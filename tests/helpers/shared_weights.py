"""A user's pipeline (tests copy it into their tmp dir) whose model holds tensors under two names:
`model.kind: aliased`, a wrapper exposing its inner model's layers as `model.blocks` (as the docs
suggest, for sharding and compilation), or `tied`, a tiny language model whose output projection
is its input embedding. The data are (input_ids, target_ids) token sequences; the loss is cross
entropy over the vocabulary. EVAL_BREAKS_AT=N in the environment makes eval_sums raise from its
N-th call on (a bad held-out row): at the N-th evaluation when the 16 held-out rows make one
batch (train.batch_size 16, one process)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import raylane

VOCAB, WIDTH = 16, 8


class Model(raylane.Section):
    kind: str = "aliased"


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self):
        return ("loss",)


class Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.norm(h)


class Aliased(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.blocks = self.inner.blocks  # the same layers, under a second name
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH) for _ in range(2)])
        self.out = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.emb.weight  # tied: one tensor, two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.out(h)


MODELS = {"aliased": Aliased, "tied": Tied}


def tokens(rows: int = 80, length: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, VOCAB, (rows, length + 1), generator=g)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


_calls = [0]


def eval_sums(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    _calls[0] += 1
    breaks_at = int(os.environ.get("EVAL_BREAKS_AT") or 0)
    if breaks_at and _calls[0] >= breaks_at:
        raise ValueError("a bad held-out row")
    return {"loss": F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="sum") / target.shape[1]}


def build(cfg: Config) -> raylane.Pipeline:
    data = tokens()
    return raylane.Pipeline(
        model=MODELS[cfg.model.kind](),
        train_set=TensorDataset(*data[:64]),
        eval_set=TensorDataset(*data[64:]),
        loss_fn=lm_loss,
        eval_sums=eval_sums,
    )
