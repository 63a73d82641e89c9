"""A small convolutional classifier for 8x8 one-channel images."""

from __future__ import annotations

import torch
from torch import nn


class ShapeNet(nn.Module):
    def __init__(self, channels: int = 8, hidden: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(channels * 16, hidden), nn.ReLU(),
                                  nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class ShapeClassifier(nn.Module):
    """ShapeNet the way models of the Hugging Face ecosystem are written: named inputs, and the
    model computes its own loss when it is given labels."""

    def __init__(self, channels: int = 8, hidden: int = 32, num_classes: int = 4) -> None:
        super().__init__()
        self.net = ShapeNet(channels, hidden, num_classes)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(pixels)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out
