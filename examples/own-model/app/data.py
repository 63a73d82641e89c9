"""A generated data set: 8x8 images of four shapes (horizontal bar, vertical bar, diagonal, hollow
square) at random places, with noise. Nothing is downloaded; the same seed gives the same images."""

from __future__ import annotations

import torch

SHAPES = ("horizontal", "vertical", "diagonal", "square")
SIZE = 8


def _stamp(kind: int, row: int, col: int) -> torch.Tensor:
    img = torch.zeros(SIZE, SIZE)
    if kind == 0:
        img[row, col : col + 4] = 1
    elif kind == 1:
        img[row : row + 4, col] = 1
    elif kind == 2:
        for i in range(4):
            img[row + i, col + i] = 1
    else:
        img[row : row + 4, col : col + 4] = 1
        img[row + 1 : row + 3, col + 1 : col + 3] = 0
    return img


def make_shapes(n: int, noise: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(images of shape [n, 1, 8, 8], labels in 0..3), deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, len(SHAPES), (n,), generator=gen)
    places = torch.randint(0, SIZE - 3, (n, 2), generator=gen)
    images = torch.stack([_stamp(int(k), int(r), int(c)) for k, (r, c) in zip(labels, places, strict=True)])
    images = images + noise * torch.randn(images.shape, generator=gen)
    return images.unsqueeze(1), labels


class ShapeRecords(torch.utils.data.Dataset):
    """The same images as dicts, the shape most modern datasets give: {"pixels", "labels"}."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixels": self.images[i], "labels": self.labels[i]}
