"""The staging copy of an asynchronous save: the state copied into CPU buffers kept from one
save to the next, the only part of a save that must happen between two optimizer steps
(raylane.loop.saving runs it on the save thread)."""

from __future__ import annotations

import copy
from typing import Any

import torch


class Stager:
    """Copies the state into CPU buffers allocated at the first save and reused by the next ones
    (fresh buffers each time cost a page fault per 4 KiB: more than the copy itself). The
    caller must not stage again while a write still reads the previous copy."""

    def __init__(self) -> None:
        self._buffers: Any = None
        self._layout: Any = None

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        sources: list[torch.Tensor] = []
        layout = _layout(state)
        if layout != self._layout:
            self._buffers, self._layout = _map_tensors(state, _empty_like), layout
        targets: list[torch.Tensor] = []
        staged = _map_tensors(state, lambda t, buf: (sources.append(_local(t)), targets.append(_local(buf)), buf)[2],
                              self._buffers)
        if sources:
            if len({t.device for t in sources}) == 1:
                torch._foreach_copy_(targets, sources, non_blocking=sources[0].device.type == "cuda")
            else:
                for target, source in zip(targets, sources, strict=True):
                    target.copy_(source, non_blocking=source.device.type == "cuda")
            if any(t.device.type == "cuda" for t in sources):
                torch.cuda.synchronize()
        return staged


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's own shard


def _layout(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        local = _local(obj)
        return (type(obj), tuple(local.shape), local.dtype, tuple(obj.shape))
    if isinstance(obj, dict):
        return tuple((k, _layout(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_layout(v) for v in obj)
    return None


def _empty_like(t: torch.Tensor, _: Any = None) -> torch.Tensor:
    local = _local(t)
    buf = torch.empty(local.shape, dtype=local.dtype, pin_memory=local.device.type == "cuda")
    if local is t:
        return buf
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(buf, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def _map_tensors(obj: Any, fn, companion: Any = None) -> Any:
    """`obj` with every tensor replaced by fn(tensor, its companion in `companion`, a structure
    like `obj`); other values copied, so that later training cannot change them either."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, companion)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, companion[k] if companion is not None else None) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(v, fn, companion[i] if companion is not None else None) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj if isinstance(obj, (int, float, str, bool, type(None))) else copy.deepcopy(obj)
