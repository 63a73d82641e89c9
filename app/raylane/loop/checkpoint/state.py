"""What a checkpoint holds of a rank's model and optimizer: their state dicts as torch's
distributed-checkpoint (DCP) API gives them, keyed by parameter name, whole on every rank
(`replicated`: DDP, one process) or a shard of them (FSDP's DTensors). Written by
raylane.loop.checkpoint.writing, read back by raylane.loop.checkpoint.loading."""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import torch

from raylane.loop.aliases import aliases, without_aliases
from raylane.loop.frozen import saved_part

# A single process without a process group is a supported DCP mode, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STATE_FILE = "state.pt"  # a replicated state's model and optimizer, written by rank 0


def dcp() -> ModuleType:
    """torch.distributed.checkpoint, imported at the first save or load rather than with this
    module: it pulls in DTensor, sympy and torch.fx (~1 s of CPU per rank on 2 cores), which
    would otherwise sit between launch and the first step of every run."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401 - get_state_dict, set_state_dict

    return dcp


def live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state DCP saves and loads: the model's and the optimizer's, keyed by parameter name,
    each tensor once (under its canonical name: raylane.loop.aliases), and without the frozen
    base of a model trained on one (raylane.loop.frozen)."""
    model_sd, optim_sd = dcp().state_dict.get_state_dict(model, optimizer)
    return {"model": saved_part(model, without_aliases(model_sd, aliases(model))), "optim": optim_sd}


def replicated(model: torch.nn.Module) -> bool:
    """Every rank holds the whole state (DDP, one process), not a shard of it (FSDP's DTensors).
    It depends on the model alone, so every rank reaches the same answer."""
    return not any(hasattr(p, "_local_tensor") for p in model.parameters())


def model_shapes(model_state: dict[str, Any]) -> dict[str, list[int]]:
    """Name -> full shape (a shard's global one) of every tensor of a model state dict."""
    return {k: list(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
