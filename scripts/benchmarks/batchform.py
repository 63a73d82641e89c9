"""B1b's pipeline: one model fed two ways, so that the cost of raylane's batch forms is measured
alone. `model.form: pair` gives `(input, target)` batches and `loss_fn`; `dict` gives
`{"features": ..., "labels": ...}` batches passed as `model(**batch)`, and the model returns
its own loss. The same weights, data and arithmetic either way (`pipeline:
scripts.benchmarks.batchform`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

import raylane


class ModelSection(raylane.Section):
    form: Literal["pair", "dict"] = "pair"
    features: int = Field(64, ge=1, le=4096)
    hidden: int = Field(128, ge=1, le=8192)
    classes: int = Field(10, ge=2, le=1000)
    num_samples: int = Field(4096, ge=64, le=1_000_000)


class Config(raylane.BaseConfig):
    model: ModelSection = ModelSection()


def build(cfg: Config) -> raylane.Pipeline:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import Dataset, TensorDataset

    m = cfg.model

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(m.features, m.hidden), nn.ReLU(), nn.Linear(m.hidden, m.classes))

        def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None):
            logits = self.net(features)
            if labels is None:
                return logits
            return {"loss": F.cross_entropy(logits, labels), "logits": logits}

    class Named(Dataset):
        """The same tensors as the pair form's TensorDataset, as dicts."""

        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.x, self.y = x, y

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"features": self.x[i], "labels": self.y[i]}

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m.num_samples, m.features, generator=gen)
    y = torch.randint(0, m.classes, (m.num_samples,), generator=gen)
    split = m.num_samples * 7 // 8
    if m.form == "pair":
        return raylane.Pipeline(
            model=Classifier(),
            train_set=TensorDataset(x[:split], y[:split]),
            eval_set=TensorDataset(x[split:], y[split:]),
            loss_fn=F.cross_entropy,
            example_input=x[:2],
        )
    return raylane.Pipeline(
        model=Classifier(), train_set=Named(x[:split], y[:split]), eval_set=Named(x[split:], y[split:])
    )
