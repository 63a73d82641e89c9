"""An MLP on your own table: Parquet or CSV files (local paths or `s3://`), feature and target
columns named in the config, classification or regression. Nothing to write in Python.

The files are streamed (raylane.loop.data.streaming.FileSource): on Ray through Ray Data, whose
tasks select and cast the columns; under torchrun and in one process each rank reads its own
share of the files with pyarrow. Classification targets are class ids 0..num_classes-1; the
report is `loss` (cross-entropy or MSE) and, for classification, `accuracy`, on `data.eval`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raylane import BaseConfig, InputPaths, Section


class DataSection(Section):
    """The table: its files, its columns and the task."""

    train: InputPaths = Field(
        min_length=1, description="Training files, directories or globs; local or `s3://bucket/prefix`."
    )
    eval: InputPaths | None = Field(None, description="Held-out files, directories or globs, with the same columns.")
    format: Literal["parquet", "csv"] = Field("parquet", description="The files' format.")
    features: list[str] = Field(min_length=1, description="The numeric feature columns.")
    target: str = Field(min_length=1, description="The target column: class ids, or a number to regress.")
    task: Literal["classification", "regression"] = Field(
        "classification", description="Cross-entropy on class ids (with accuracy), or MSE on a number."
    )
    num_classes: int | None = Field(
        None,
        ge=2,
        le=1_000_000,
        description="Classification: the number of classes (targets are integers 0..num_classes-1); required there.",
    )
    shuffle_rows: int = Field(4096, ge=1, le=100_000_000, description="Rows in each rank's shuffle buffer.")
    skip_bad_rows: bool | int = Field(
        False,
        ge=0,
        description="Rows with a missing or non-numeric feature or target, or a class id out of range: `false` fails "
        "the run naming the first one's file, row and column; `true` skips them; N skips at most N in each of "
        "data.train and data.eval (more fails the run before its first step). The rows are counted before "
        "training; the summary's `skipped_rows` and the terminal give the count and the first one.",
    )


class ModelSection(Section):
    """The MLP."""

    hidden_size: int = Field(64, ge=1, le=65_536, description="Width of each hidden layer.")
    num_layers: int = Field(2, ge=1, le=64, description="Hidden layers.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after each hidden layer (0: none).")
    # A stream has no up-front pass to measure the columns' scales, hence running statistics.
    input_norm: bool = Field(
        True,
        description="Standardize the features by their running mean and variance, updated while training and saved "
        "with the weights (raw columns of very different scales train poorly).",
    )


class Config(BaseConfig):
    pipeline: Literal["tabular"] = "tabular"
    data: DataSection
    model: ModelSection = ModelSection()

    def gives_tp_plan(self) -> bool:
        return False

    def gives_pp_stages(self) -> bool:
        return False

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
                # The files exist, have the columns, and the first file's first rows hold numbers
                # in range: exit 2 naming the row otherwise. Later rows are checked as they are read.
                source(self, paths, field).check(field)
                source(self, paths, field).sample(field, transformed=True)
        return self


def checked(d: DataSection, batch: dict):
    """(features as float32 rows, targets) of a batch, or a DataError naming the first bad cell
    (the first bad row's first bad column, features before the target): a missing or
    non-numeric value, or a class id outside 0..num_classes-1; its `rows` list every bad row."""
    import numpy as np

    columns = [*d.features, d.target]
    values = [_numbers(batch[c]) for c in columns]  # float64, NaN where a cell is not a number
    bad = np.stack([~np.isfinite(v) for v in values], axis=1)
    y = values[-1]
    out_of_range: np.ndarray = np.zeros(len(y), dtype=bool)
    if d.task == "classification":
        with np.errstate(invalid="ignore"):
            out_of_range = np.isfinite(y) & ((y < 0) | (y >= d.num_classes) | (y != np.floor(y)))
        bad[:, -1] |= out_of_range
    rows = np.flatnonzero(bad.any(axis=1))
    if len(rows):
        row = int(rows[0])
        col = int(np.argmax(bad[row]))
        column, value = columns[col], batch[columns[col]][row]
        if col == len(columns) - 1 and out_of_range[row]:
            from raylane import DataError

            raise DataError(
                f"data.num_classes = {d.num_classes}",
                column=column,
                row=row,
                rows=rows.tolist(),
                value=value,
                why=f"class ids are whole numbers 0..{d.num_classes - 1}",
            )
        _bad_value("data.target" if col == len(columns) - 1 else "data.features", column, row, value, rows.tolist())
    x = np.stack(values[:-1], axis=1).astype(np.float32)
    return x, (y.astype(np.float32) if d.task == "regression" else y.astype(np.int64))


def _numbers(values):
    """A column as float64, NaN where a cell is missing or not a number (text is read as a
    number where it is one)."""
    import numpy as np

    if values.dtype.kind in "biuf":
        return values.astype(np.float64)
    out = np.full(len(values), np.nan)
    for row, value in enumerate(values):  # text or objects
        try:
            out[row] = float(value)
        except (TypeError, ValueError):
            pass
    return out


def _bad_value(key: str, column: str, row: int, value, rows: list[int]) -> None:
    import math

    from raylane import DataError

    if value is None or (isinstance(value, float) and math.isnan(value)):
        why = "fill or drop such rows, a missing value would train as NaN (data.skip_bad_rows: true skips such rows)"
    elif isinstance(value, str):
        why = "expected a number (encode categories as numbers)"
    else:
        why = "expected a finite number"
    raise DataError(key, column=column, row=row, rows=rows, value=value, why=why)


def source(cfg: Config, paths, key: str | None = None):
    """The FileSource of `paths` (config key `key`): the transform (Ray Data's map_batches on
    Ray) turns the named columns into one float32 matrix `x` and the target `y`, after checking
    every value (raylane.DataError names a bad one's file, row and column)."""
    from raylane import FileSource

    d = cfg.data
    classify = d.task == "classification"

    def transform(batch):
        x, y = checked(d, batch)
        return {"x": x, "y": y}

    def to_tensors(batch):
        import torch

        y = torch.tensor(batch["y"])  # a copy: arrays read from Arrow are read-only
        return torch.tensor(batch["x"]), (y if classify else y[:, None])

    return FileSource(
        paths=paths,
        format=d.format,
        columns=[*d.features, d.target],
        transform=transform,
        to_tensors=to_tensors,
        shuffle_rows=d.shuffle_rows,
        key=key,
        skip_bad_rows=d.skip_bad_rows,
    )


def sources(cfg: Config):
    """What a streaming pipeline declares for the driver (Ray Data), without building a model."""
    return {
        "train": source(cfg, cfg.data.train, "data.train"),
        "eval": source(cfg, cfg.data.eval, "data.eval") if cfg.data.eval is not None else None,
    }


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
                    self.var.copy_(
                        (self.var * seen + x.var(0, unbiased=False) * n + delta**2 * seen * n / total) / total
                    )
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

    from raylane import Pipeline

    classify = cfg.data.task == "classification"
    loss_fn = F.cross_entropy if classify else F.mse_loss

    def eval_sums(output, target):
        if not classify:
            return {"loss": F.mse_loss(output, target, reduction="sum")}
        return {
            "loss": F.cross_entropy(output, target, reduction="sum"),
            "accuracy": (output.argmax(dim=1) == target).sum().to(torch.float32),
        }

    data = sources(cfg)
    # The logged model's signature and torch.export need an input; a stream has none to spare.
    example = torch.zeros(2, len(cfg.data.features))
    return Pipeline(
        model=build_model(cfg),
        train_set=data["train"],
        eval_set=data["eval"],
        loss_fn=loss_fn,
        eval_sums=eval_sums,
        example_input=example,
    )
