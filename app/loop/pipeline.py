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
