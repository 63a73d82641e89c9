"""What a run with expert parallelism shows (issue 65): each logging window, rank 0's tokens per
expert, how unevenly they fall, the pairs its capacity dropped and its time in the dispatch's
all-to-alls (`train/experts/*`); at the end, the run's over every rank, for the summary.

Bounded whatever the model: five numbers a window for 64 experts x 48 layers as for 4 x 2 (the
per-expert counts stay on the device, raylane.loop.distributed.expert_parallel's counters).
Nothing is added to the step: the counters are read once a window, on rank 0, where the window's
loss is read anyway (one more device-to-host copy, no collective); every rank adds them into its
run totals on the device and zeroes them. The run's totals are summed over the ranks by one
all-reduce after the last step, for the summary.

- `tokens_min`, `tokens_max`: the fewest and the most (token, expert) pairs rank 0's router sent
  one expert in the window, over every experts module's experts (dropped pairs included: what
  the router chose).
- `imbalance`: the worst module's most loaded expert over its mean expert. The worst layer, not
  all layers pooled: one collapsed layer makes its experts' ranks the slowest of every step,
  and pooling with balanced layers would hide it. 1 is even; E is every pair on one expert (k 1).
- `dropped_tokens`: the pairs rank 0's capacity dropped (strategy.ep_capacity_factor; 0 without
  one). A token with k choices can lose some of them: pairs, not tokens.
- `all_to_all_share`: rank 0's seconds in the all-to-alls over the window's seconds, where the
  host's clock measures them (CPU, gloo: expert_parallel.dispatch_seconds); absent on a GPU,
  where only a device sync per call could (the benchmark measures it there).

Rank 0's figures stand for the group's as its loss does (ranks draw rows alike); the summary's
are every rank's. Counted in training forwards only (not evaluation); an activation recompute
counts its forward again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raylane.loop.distributed.expert_parallel import dispatch_seconds, expert_parallel_modules


def load_figures(counts: Sequence[Sequence[int]], dropped: int) -> dict[str, float]:
    """The figures of tokens per expert `counts` (one sequence per experts module) and `dropped`
    pairs: tokens_min, tokens_max, imbalance (left out when no pair was routed), dropped_tokens."""
    every = [n for module in counts for n in module]
    figures = {"tokens_min": float(min(every)), "tokens_max": float(max(every))}
    means = [(max(module), sum(module) / len(module)) for module in counts if sum(module)]
    if means:
        figures["imbalance"] = max(most / mean for most, mean in means)
    return figures | {"dropped_tokens": float(dropped)}


class ExpertFigures:
    """A model's expert-parallel modules' counters, read per window (`window`, rank 0), carried
    into the run's totals and zeroed (`reset`, every rank), summed over the ranks at the end
    (`summary`, every rank: a collective)."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = list(modules.values())
        first = self.modules[0]
        self.ep, self.factor = first.ep_mesh.size(), first.ep_capacity_factor
        # The run's totals, made at the first reset where the counters are then (a model built on
        # the meta device gets them on its device at its first forward).
        self.run_tokens: list[torch.Tensor] | None = None
        self.run_dropped: torch.Tensor | None = None
        dispatch_seconds(reset=True)

    @classmethod
    def of(cls, model: nn.Module | None) -> ExpertFigures | None:
        """None for a model without expert-parallel modules: a dense model's windows pay nothing."""
        modules = expert_parallel_modules(model) if model is not None else {}
        return cls(modules) if modules else None

    def _counts(self) -> tuple[list[list[int]], int]:
        """(tokens per expert per module, dropped) in the window so far."""
        dropped = torch.stack([m.ep_dropped for m in self.modules]).sum().reshape(1)
        flat = torch.cat([*(m.ep_tokens for m in self.modules), dropped.to(self.modules[0].ep_tokens)])
        return self._split(flat.tolist())  # the one device-to-host copy

    def _split(self, flat: list[int]) -> tuple[list[list[int]], int]:
        counts, at = [], 0
        for m in self.modules:
            counts.append(flat[at : at + m.ep_experts])
            at += m.ep_experts
        return counts, flat[at]

    def window(self, seconds: float) -> dict[str, float]:
        """The window's figures (`seconds` long), under experts/ (module docstring)."""
        counts, dropped = self._counts()
        figures = load_figures(counts, dropped)
        if (spent := dispatch_seconds()) is not None and seconds > 0:
            figures["all_to_all_share"] = min(spent / seconds, 1.0)
        return {f"experts/{name}": value for name, value in figures.items()}

    def reset(self) -> None:
        """The window's counts carried into the run's, on the device, and the next window begun."""
        self.run_tokens, self.run_dropped = self._totals()
        for m in self.modules:
            m.ep_tokens.zero_()
            m.ep_dropped.zero_()
        dispatch_seconds(reset=True)

    def _totals(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(tokens per expert per module, dropped) over the run: its totals and the window's."""
        tokens = [m.ep_tokens.clone() for m in self.modules]
        dropped = torch.stack([m.ep_dropped for m in self.modules]).sum()
        if self.run_tokens is not None and self.run_dropped is not None:
            tokens = [t + total for t, total in zip(tokens, self.run_tokens, strict=True)]
            dropped = dropped + self.run_dropped
        return tokens, dropped

    def summary(self) -> dict[str, Any]:
        """The run's figures over every rank (the summary's `experts`): an all-reduce, so every
        rank calls it, once, after the last step."""
        tokens, dropped = self._totals()
        flat = torch.cat([*(t.reshape(-1) for t in tokens), dropped.reshape(1)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flat)
        counts, dropped_all = self._split(flat.tolist())
        figures = load_figures(counts, dropped_all)
        return {
            "modules": len(self.modules),
            "experts": max(m.ep_experts for m in self.modules),
            "ep": self.ep,
            "capacity_factor": self.factor,
            "routed": sum(map(sum, counts)),
            "tokens_min": int(figures["tokens_min"]),
            "tokens_max": int(figures["tokens_max"]),
            "imbalance": round(figures["imbalance"], 4) if "imbalance" in figures else None,
            "dropped": dropped_all,
        }
