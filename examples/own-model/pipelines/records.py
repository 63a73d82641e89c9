"""The second pipeline of this project: dict batches, and a model that computes its own loss
(app/model.py's ShapeClassifier). raylane calls `model(**batch)` and takes `output["loss"]`:
there is no loss_fn. `raylane train train-records.yaml` from this folder."""

from __future__ import annotations

import raylane

from app.data import ShapeRecords, make_shapes
from app.model import ShapeClassifier
from pipelines.shapes import ModelSection


class Config(raylane.BaseConfig):
    model: ModelSection = ModelSection()

    def eval_metrics(self) -> tuple[str, ...]:
        return ("loss", "accuracy")


def build(cfg: Config) -> raylane.Pipeline:
    import torch

    m = cfg.model
    x, y = make_shapes(m.num_samples, m.noise, m.data_seed)
    split = int(0.8 * m.num_samples)

    def eval_sums(output: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # Sums over the batch: raylane adds them up over every rank and divides by the sample count.
        labels = batch["labels"]
        return {"loss": output["loss"] * len(labels),
                "accuracy": (output["logits"].argmax(dim=1) == labels).sum().float()}

    return raylane.Pipeline(
        model=ShapeClassifier(m.channels, m.hidden),
        train_set=ShapeRecords(x[:split], y[:split]),
        eval_set=ShapeRecords(x[split:], y[split:]),
        eval_sums=eval_sums,
    )
