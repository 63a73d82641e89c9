"""The staging copy of an asynchronous save: the state copied into CPU buffers kept from one
save to the next, the only part of a save that must happen between two optimizer steps
(raylane.loop.checkpoint.saving runs it on the save thread)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from raylane.loop.checkpoint.aliases import aliases, without_aliases
from raylane.loop.checkpoint.frozen import saved_part


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
        staged = _map_tensors(
            state, lambda t, buf: (sources.append(_local(t)), targets.append(_local(buf)), buf)[2], self._buffers
        )
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


class LiveState:
    """References to a replicated model's and optimizer's state, in DCP's format (keyed by
    parameter name), taken without DCP's get_state_dict: its generic path cost ~0.3 ms of the
    training thread per save on 2 busy cores (bench B9), against ~0.03 ms for the modules' own
    state_dict() renamed by a map built once. The first call checks the two agree, key for key
    and tensor for tensor, and keeps to DCP for good if they do not (a wrapper this map does not
    know). Both hold each tensor once: a tied weight or a submodule under two names is saved
    under its canonical name only (raylane.loop.checkpoint.aliases)."""

    def __init__(self) -> None:
        self._names: list[str] | None = None  # the optimizer's parameter index -> name
        self._aliases: dict[str, str] = {}
        self._checked = False

    def take(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dcp_state) -> dict[str, Any]:
        """`dcp_state(model, optimizer)`: DCP's way, the reference."""
        if self._checked and self._names is None:
            return dcp_state(model, optimizer)
        module = model.module if isinstance(model, DistributedDataParallel) else model
        if self._checked and len(self._names) != sum(len(g["params"]) for g in optimizer.param_groups):
            self._checked = False  # a parameter group was added since (unfreezing): check again
        if not self._checked:
            names = {id(p): n for n, p in module.named_parameters()}
            ordered = [p for group in optimizer.param_groups for p in group["params"]]
            self._names = [names.get(id(p), "") for p in ordered]
            self._aliases = aliases(model)
            fast, reference = self._take(module, optimizer), dcp_state(model, optimizer)
            self._checked = True
            if not _same(fast, reference):
                self._names = None
            return reference
        return self._take(module, optimizer)

    def _take(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        names = self._names
        packed = optimizer.state_dict()
        # Each parameter's dict copied: the loop may rebind a plain value in it (a float `step`)
        # while the save thread still reads it.
        optim = {
            "state": {names[i]: dict(v) for i, v in packed["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in packed["param_groups"]],
        }
        return {"model": saved_part(module, without_aliases(module.state_dict(), self._aliases)), "optim": optim}


def _same(a: Any, b: Any) -> bool:
    """The same structure, plain values and tensors (the same memory, not only equal)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape
            and a.dtype == b.dtype
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b
