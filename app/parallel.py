"""The one place that decides how a model is distributed. Models know nothing of it."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from app.config import BaseConfig


def parallelize(model: torch.nn.Module, cfg: BaseConfig, device: torch.device, world_size: int) -> torch.nn.Module:
    model = model.to(device)
    if world_size == 1:
        return model  # DDP on one rank only adds hooks and a broadcast
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DDP) else model
