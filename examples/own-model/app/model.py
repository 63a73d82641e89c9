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
