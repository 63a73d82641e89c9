"""Tensors a model holds under more than one name: a submodule registered twice (a wrapper's
`self.blocks = self.inner.blocks`, which exposes `model.blocks` for sharding and compilation) or
a tied weight (a language model's output projection that is its input embedding). A checkpoint
holds each tensor once, under its canonical name (the first `named_parameters`, then
`named_buffers`, gives it); the other names are aliases, filled back in on load. Loading every
name would not work: DCP's set_state_dict on a DDP model leaves the aliases without DDP's
`module.` prefix ("Missing key(s) module.blocks.0... Unexpected key(s) blocks.0...")."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

# A parallelized model's names are fixed: one walk of its modules per model, not one per save.
_found: weakref.WeakKeyDictionary[nn.Module, dict[str, str]] = weakref.WeakKeyDictionary()


def _plain(name: str) -> str:
    """A name as DCP's state dicts spell it: without torch.compile's `_orig_mod.`."""
    return name.replace("_orig_mod.", "")


def aliases(model: nn.Module) -> dict[str, str]:
    """alias -> canonical name of every tensor of `model` (DDP, FSDP2 or a plain module) that has
    more than one name; empty for most models. Cached per model object."""
    found = _found.get(model)
    if found is None:
        module = model.module if isinstance(model, DistributedDataParallel) else model
        first: dict[int, str] = {}
        found = {}
        named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        for name, tensor in named:
            name = _plain(name)
            canonical = first.setdefault(id(tensor), name)
            if canonical != name:
                found[name] = canonical
        _found[model] = found
    return found


def without_aliases(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`state` (a model state dict) with each tensor once, under its canonical name."""
    return {k: v for k, v in state.items() if k not in names} if names else state


def with_aliases(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """A canonical state dict with every alias filled in from its canonical tensor: what a
    plain `load_state_dict` (strict) of the model expects."""
    return {**state, **{alias: state[canonical] for alias, canonical in names.items() if canonical in state}}


def unexplained(missing: Iterable[str], names: dict[str, str]) -> list[str]:
    """The keys a non-strict load reported missing that are not aliases (DDP prefixes them)."""
    return sorted(k for k in (_plain(m.removeprefix("module.")) for m in missing) if k not in names)
