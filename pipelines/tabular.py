"""An MLP on your own table: Parquet or CSV files (local paths or `s3://`), feature and target
columns named in the config, classification or regression. Nothing to write in Python.

The files are streamed (raylane.loop.streaming.FileSource): on Ray through Ray Data, whose
tasks select and cast the columns; under torchrun and in one process each rank reads its own
share of the files with pyarrow. Classification targets are class ids 0..num_classes-1; the
report is `loss` (cross-entropy or MSE) and, for classification, `accuracy`, on `data.eval`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raylane.config import BaseConfig, Section
from raylane.paths import InputPaths


class DataSection(Section):
    # Files, directories or globs; local or s3://bucket/prefix.
    train: InputPaths = Field(min_length=1)
    eval: InputPaths | None = None
    format: Literal["parquet", "csv"] = "parquet"
    features: list[str] = Field(min_length=1)
    target: str = Field(min_length=1)
    task: Literal["classification", "regression"] = "classification"
    # Classification: targets are integers 0..num_classes-1.
    num_classes: int | None = Field(None, ge=2, le=1_000_000)
    # Rows of the per-rank shuffle buffer.
    shuffle_rows: int = Field(4096, ge=1, le=100_000_000)


class ModelSection(Section):
    hidden_size: int = Field(64, ge=1, le=65_536)
    num_layers: int = Field(2, ge=1, le=64)
    dropout: float = Field(0.0, ge=0, lt=1)
    # Standardize the features by their running mean and variance, updated while training (and
    # saved with the weights): raw columns of very different scales train poorly, and a stream
    # has no up-front pass to measure them.
    input_norm: bool = True


class Config(BaseConfig):
    pipeline: Literal["tabular"] = "tabular"
    data: DataSection
    model: ModelSection = ModelSection()

    def eval_metrics(self) -> tuple[str, ...]:
        return ("loss", "accuracy") if self.data.task == "classification" else ("loss",)

    @model_validator(mode="after")
    def _data_is_there(self) -> Config:
        d = self.data
        if d.task == "classification" and d.num_classes is None:
            raise ValueError("data.num_classes = None: required for data.task = 'classification'")
        if d.target in d.features:
            raise ValueError(f"data.target = {d.target!r}: also listed in data.features")
        for field, paths in (("data.train", d.train), ("data.eval", d.eval)):
            if paths is not None:
                source(self, paths).check(field)  # the files exist and have the columns: exit 2 otherwise
                _numeric(field, source(self, paths).sample(field), [*d.features, d.target])
        return self


def _numeric(field: str, sample: dict, columns: list[str]) -> None:
    """Every named column holds numbers (a CSV's 'cat'/'dog' target fails here, not on a rank)."""
    import numpy as np

    for column in columns:
        values = sample.get(column)
        if values is not None and len(values) and not (np.issubdtype(values.dtype, np.number) or values.dtype == bool):
            raise ValueError(f"data.{'target' if column == columns[-1] else 'features'} = {column!r}: column of "
                             f"{field} is not numeric (first value {values[0]!r}); encode it as numbers")


def source(cfg: Config, paths):
    """The FileSource of `paths`: the transform (Ray Data's map_batches on Ray) turns the named
    columns into one float32 matrix `x` and the target `y`."""
    import numpy as np

    from raylane.loop.streaming import FileSource

    d = cfg.data
    classify = d.task == "classification"

    def transform(batch):
        x = np.stack([np.asarray(batch[c], dtype=np.float32) for c in d.features], axis=1)
        y = np.asarray(batch[d.target], dtype=np.int64 if classify else np.float32)
        if classify and len(y) and (y.min() < 0 or y.max() >= d.num_classes):
            bad = y[(y < 0) | (y >= d.num_classes)][0]
            raise ValueError(f"data.target = {d.target!r}: class id {bad} outside 0..{d.num_classes - 1} "
                             f"(data.num_classes = {d.num_classes})")
        return {"x": x, "y": y}

    def to_tensors(batch):
        import torch

        y = torch.tensor(batch["y"])  # a copy: arrays read from Arrow are read-only
        return torch.tensor(batch["x"]), (y if classify else y[:, None])

    return FileSource(paths=paths, format=d.format, columns=[*d.features, d.target], transform=transform,
                      to_tensors=to_tensors, shuffle_rows=d.shuffle_rows)


def sources(cfg: Config):
    """What a streaming pipeline declares for the driver (Ray Data), without building a model."""
    return {"train": source(cfg, cfg.data.train),
            "eval": source(cfg, cfg.data.eval) if cfg.data.eval is not None else None}


def build_model(cfg: Config):
    import torch
    from torch import nn

    class Standardize(nn.Module):
        """(x - mean) / std over every row seen in training: Chan's parallel update of the
        running moments. Unlike BatchNorm, a batch of one row is fine (a stream's last batch)."""

        def __init__(self, width: int) -> None:
            super().__init__()
            for name, init in (("mean", torch.zeros(width)), ("var", torch.ones(width)), ("count", torch.zeros(()))):
                self.register_buffer(name, init)

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    n, seen = x.shape[0], self.count.clone()
                    total = seen + n
                    delta = x.mean(0) - self.mean
                    self.var.copy_((self.var * seen + x.var(0, unbiased=False) * n + delta**2 * seen * n / total) / total)
                    self.mean.add_(delta * n / total)
                    self.count.copy_(total)
            return (x - self.mean) / (self.var.sqrt() + 1e-5)

    m, width = cfg.model, len(cfg.data.features)
    layers: list[nn.Module] = [Standardize(width)] if m.input_norm else []
    for _ in range(m.num_layers):
        layers += [nn.Linear(width, m.hidden_size), nn.ReLU()]
        if m.dropout:
            layers.append(nn.Dropout(m.dropout))
        width = m.hidden_size
    layers.append(nn.Linear(width, cfg.data.num_classes if cfg.data.task == "classification" else 1))
    return nn.Sequential(*layers)


def build(cfg: Config):
    import torch
    import torch.nn.functional as F

    from raylane.loop.pipeline import Pipeline

    classify = cfg.data.task == "classification"
    loss_fn = F.cross_entropy if classify else F.mse_loss

    def eval_sums(output, target):
        if not classify:
            return {"loss": F.mse_loss(output, target, reduction="sum")}
        return {"loss": F.cross_entropy(output, target, reduction="sum"),
                "accuracy": (output.argmax(dim=1) == target).sum().to(torch.float32)}

    data = sources(cfg)
    # The logged model's signature and torch.export need an input; a stream has none to spare.
    example = torch.zeros(2, len(cfg.data.features))
    return Pipeline(model=build_model(cfg), train_set=data["train"], eval_set=data["eval"],
                    loss_fn=loss_fn, eval_sums=eval_sums, example_input=example)
