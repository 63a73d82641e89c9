"""A raylane pipeline of this project's own: ShapeNet (app/model.py) on generated shapes
(app/data.py). `pipeline: ./pipelines/shapes.py` (or `pipelines.shapes`) in train.yaml points
raylane here; see docs/pipelines.md in raylane for the contract."""

from __future__ import annotations

import raylane
from pydantic import Field

from app.data import make_shapes  # this project's own app/, not raylane's
from app.model import ShapeNet


class ModelSection(raylane.Section):
    channels: int = Field(8, ge=1, le=256)
    hidden: int = Field(32, ge=1, le=4096)
    num_samples: int = Field(2000, ge=10, le=5000)
    noise: float = Field(0.3, ge=0, le=2)
    data_seed: int = Field(0, ge=0)


class Config(raylane.BaseConfig):
    model: ModelSection = ModelSection()


def build(cfg: Config) -> raylane.Pipeline:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    m = cfg.model
    x, y = make_shapes(m.num_samples, m.noise, m.data_seed)  # the same on every rank
    split = int(0.8 * m.num_samples)

    def eval_sums(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.cross_entropy(output, target, reduction="sum"),
                "accuracy": (output.argmax(dim=1) == target).sum().float()}

    return raylane.Pipeline(
        model=ShapeNet(m.channels, m.hidden),
        train_set=TensorDataset(x[:split], y[:split]),
        eval_set=TensorDataset(x[split:], y[split:]),
        loss_fn=F.cross_entropy,
        eval_sums=eval_sums,
        example_input=x[:2],
    )
