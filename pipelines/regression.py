"""The tutorial's workload: Linear(20, 1) on 2,048 random samples, MSE loss.

Its steps are tiny, so per-step orchestration overhead shows up here first."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from raylane import BaseConfig, Section


class ModelSection(Section):
    """A Linear(in_features, 1) and its random data (the same whatever train.seed is)."""

    in_features: int = Field(20, ge=1, le=100_000, description="Inputs of the linear model.")
    num_samples: int = Field(2048, ge=1, le=10_000_000, description="Random training samples.")
    num_eval_samples: int = Field(512, ge=1, le=10_000_000, description="Random held-out samples.")


class Config(BaseConfig):
    pipeline: Literal["regression"] = "regression"
    model: ModelSection = ModelSection()

    def gives_tp_plan(self) -> bool:
        return False

    def gives_pp_stages(self) -> bool:
        return False

    def eval_metrics(self) -> tuple[str, ...]:
        return ("loss",)


def build(cfg: Config):
    import torch
    from torch.utils.data import TensorDataset

    from raylane import Pipeline

    m = cfg.model
    # The data is fixed (seed 0) whatever train.seed is, so runs with different seeds compare.
    gen = torch.Generator().manual_seed(0)
    n = m.num_samples + m.num_eval_samples
    x = torch.rand(n, m.in_features, generator=gen)
    y = torch.rand(n, 1, generator=gen)
    train = TensorDataset(x[: m.num_samples], y[: m.num_samples])
    held_out = TensorDataset(x[m.num_samples :], y[m.num_samples :])

    def eval_sums(output, target):
        return {"loss": torch.nn.functional.mse_loss(output, target, reduction="sum")}

    return Pipeline(
        model=torch.nn.Linear(m.in_features, 1),
        train_set=train,
        eval_set=held_out,
        loss_fn=torch.nn.functional.mse_loss,
        eval_sums=eval_sums,
        example_input=x[:2],
    )
