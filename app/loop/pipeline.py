"""What a pipeline hands to the trainer: built outside it, passed in (the tutorial's shape)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset


@dataclass
class Pipeline:
    model: torch.nn.Module
    train_set: Dataset
    eval_set: Dataset | None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # (output, target) -> {metric: sum over the batch}; divided by the sample count after the
    # all-reduce, so every metric is exact whatever the world size.
    eval_sums: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]
    example_input: Any = None
    # Language models: tokens in one sample, and model FLOPs per token (forward and backward),
    # for tokens_per_s and MFU.
    tokens_per_sample: int | None = None
    flops_per_token: float | None = None


def example_batch(pipe: Pipeline, rows: int = 2) -> Any:
    """The pipeline's `example_input`, or else the first `rows` inputs of its eval set (or its
    train set) stacked into a batch: what an MLflow model's signature and input example are made
    from. ValueError when neither gives one (a streaming set, inputs that are not tensors)."""
    if pipe.example_input is not None:
        return pipe.example_input
    for data in (pipe.eval_set, pipe.train_set):
        try:
            items = [data[i] for i in range(rows)]
        except (TypeError, IndexError, KeyError, NotImplementedError):  # None, iterable-only, too short
            continue
        inputs = [x[0] if isinstance(x, (tuple, list)) else x for x in items]
        if all(isinstance(x, torch.Tensor) for x in inputs) and len({x.shape for x in inputs}) == 1:
            return torch.stack(inputs)
    raise ValueError("the pipeline sets no example_input, and its datasets' first inputs are not tensors of one "
                     f"shape: give build(cfg)'s Pipeline an example_input (a batch of {rows} rows or more)")
