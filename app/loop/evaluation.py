"""Held-out evaluation: the pipeline's metric sums over this rank's share of the held-out data,
summed over every rank and divided by the number of samples: exact over all ranks, whatever
their shares."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from raylane.loop.distributed import all_reduce_sums


class Evaluator:
    def __init__(self, data: Iterable[tuple[torch.Tensor, torch.Tensor]],
                 sums: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
                 device: torch.device, world_size: int) -> None:
        self.data, self.sums, self.device, self.world_size = data, sums, device, world_size
        self._names: list[str] | None = None

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        """Collective. Leaves `model` in eval mode: the loop sets train mode at each epoch."""
        model.eval()
        # DDP's forward broadcasts buffers (BatchNorm's statistics): a collective per batch, which
        # hangs when ranks hold different numbers of held-out batches (a stream's file shares).
        # Evaluation needs no gradient sync, so it runs the wrapped module itself.
        module = model.module if isinstance(model, DistributedDataParallel) else model
        sums: dict[str, torch.Tensor] = {}
        count = 0
        for source, targets in self.data:
            output = module(source.to(self.device))
            for name, value in self.sums(output, targets.to(self.device)).items():
                sums[name] = sums.get(name, 0) + value
            count += len(targets)
        for name in self._agreed_names(sums):  # a rank whose share was empty sums zeros
            sums.setdefault(name, torch.zeros((), device=self.device))
        sums["count"] = torch.tensor(float(count))
        totals = all_reduce_sums(sums)
        n = totals.pop("count")
        return {k: v / max(n, 1.0) for k, v in totals.items()}

    def _agreed_names(self, sums: dict[str, torch.Tensor]) -> list[str]:
        """The metric names, agreed by every rank once (all_reduce_sums needs the same keys
        everywhere, and a stream's held-out share may be empty on some rank)."""
        if self._names is None:
            names = [sorted(sums)]
            if self.world_size > 1:
                import torch.distributed as dist

                gathered: list[Any] = [None] * self.world_size
                dist.all_gather_object(gathered, names[0])
                names = gathered
            self._names = sorted(set().union(*names))
        return self._names
