"""A user's pipeline (tests copy it into their tmp dir) whose model keeps its repeated layers where
most models do, not at `model.blocks`: `model.encoder.layers`, a ModuleList of 2 Layers that hold
most of the weights. `model.blocks_at` (a dotted path) hands them to raylane as the pipeline's
`blocks`; empty, raylane finds them itself. `model.kind: flat` is a model with no repeated layers at
all. A regression on random rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import raylane

WIDTH, LAYERS = 64, 2


class Model(raylane.Section):
    kind: str = "nested"
    blocks_at: str = ""


class Config(raylane.BaseConfig):
    model: Model = Model()


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer() for _ in range(LAYERS)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, WIDTH)
        self.encoder = Encoder()
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


class Flat(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def eval_sums(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": F.mse_loss(output, target, reduction="sum")}


def build(cfg: Config) -> raylane.Pipeline:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    model = Net() if cfg.model.kind == "nested" else Flat()
    return raylane.Pipeline(
        model=model,
        train_set=TensorDataset(x[:64], y[:64]),
        eval_set=TensorDataset(x[64:], y[64:]),
        loss_fn=mse,
        eval_sums=eval_sums,
        blocks=cfg.model.blocks_at or None,
    )
