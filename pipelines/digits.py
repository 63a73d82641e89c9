"""scikit-learn's bundled 8x8 digits (1,797 images, no download): an MLP classifier.

The 80/20 split uses a fixed seed, so every run and every world size evaluates on the same
held-out images; `accuracy` and `loss` are reported on them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from raylane import BaseConfig, Section

SPLIT_SEED = 0
HELD_OUT_FRACTION = 0.2


class ModelSection(Section):
    """The MLP classifier of 8x8 images (64 inputs, 10 classes)."""

    hidden_size: int = Field(128, ge=1, le=65_536, description="Width of each hidden layer.")
    num_layers: int = Field(2, ge=1, le=64, description="Hidden layers, each Linear then ReLU.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after each hidden layer (0: none).")


class Config(BaseConfig):
    pipeline: Literal["digits"] = "digits"
    model: ModelSection = ModelSection()

    def gives_tp_plan(self) -> bool:
        return False

    def gives_pp_stages(self) -> bool:
        return False

    def eval_metrics(self) -> tuple[str, ...]:
        return ("loss", "accuracy")


def build_model(m: ModelSection):
    from torch import nn

    layers: list[nn.Module] = []
    width = 64
    for _ in range(m.num_layers):
        layers += [nn.Linear(width, m.hidden_size), nn.ReLU()]
        if m.dropout:
            layers.append(nn.Dropout(m.dropout))
        width = m.hidden_size
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def load_digits_arrays():
    """The CSV that ships inside scikit-learn, read without importing sklearn (1.4 s per worker)."""
    import importlib.util
    from pathlib import Path

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # locates the package, imports nothing
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    data = np.loadtxt(path, delimiter=",", dtype=np.float32)
    return data[:, :-1], data[:, -1].astype(np.int64)


def load_split():
    import torch
    from torch.utils.data import TensorDataset

    images, labels = load_digits_arrays()
    x = torch.from_numpy(images) / 16.0  # pixel values are 0..16
    y = torch.from_numpy(labels)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_held_out = int(len(x) * HELD_OUT_FRACTION)
    held, train = order[:n_held_out], order[n_held_out:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[held], y[held])


def build(cfg: Config):
    import torch
    import torch.nn.functional as F

    from raylane import Pipeline

    train, held_out = load_split()

    def eval_sums(output, target):
        return {
            "loss": F.cross_entropy(output, target, reduction="sum"),
            # Summed here, divided by the sample count after the all-reduce: exact accuracy.
            "accuracy": (output.argmax(dim=1) == target).sum().to(torch.float32),
        }

    return Pipeline(
        model=build_model(cfg.model),
        train_set=train,
        eval_set=held_out,
        loss_fn=F.cross_entropy,
        eval_sums=eval_sums,
        example_input=held_out.tensors[0][:2],
    )
