"""A model's blocks: its repeated layers, the unit of FSDP sharding, activation checkpointing and
compile. Found in this order, the first that gives any:

1. the pipeline's `blocks`: modules of the model (a list or ModuleList), or the dotted path of a
   ModuleList or Sequential in it ("encoder.layers");
2. `model.blocks`, a ModuleList or Sequential;
3. a Hugging Face model's `_no_split_modules` (class names, on the model or its `base_model`):
   every module of those classes, outermost first (duck-typed: transformers is not imported);
4. the model's largest repeated ModuleList or Sequential, anywhere in it: at least 2 children of
   one class that hold parameters, largest by parameter count (a container held under two names
   counts once);
5. a Sequential model's layers that hold weights.

None found: FSDP shards the whole model as one unit, nothing is recomputed, and compile takes the
whole model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass
class Blocks:
    modules: list[nn.Module]
    where: str = ""  # the dotted path of their parent in the model ("" for the model itself)
    source: str = ""  # which rule found them

    def describe(self) -> str:
        """`2 x GPTBlock at transformer.h (_no_split_modules)`, or what having none means."""
        if not self.modules:
            return "none found (FSDP shards the whole model as one unit)"
        kinds = list(dict.fromkeys(type(m).__name__ for m in self.modules))
        what = f"{len(self.modules)} x {kinds[0]}" if len(kinds) == 1 else f"{len(self.modules)} ({', '.join(kinds)})"
        return f"{what} at {self.where or 'the model'} ({self.source})"


def given_blocks(model: nn.Module, given: Any) -> list[nn.Module]:
    """The modules a pipeline's `blocks` names; TypeError or ValueError saying what is wrong with it."""
    if isinstance(given, str):
        try:
            found = model.get_submodule(given)
        except AttributeError:
            raise ValueError(f"blocks = {given!r} names no module of the model") from None
        if not isinstance(found, CONTAINERS):
            raise TypeError(f"blocks = {given!r} is a {type(found).__name__}, not a ModuleList or Sequential")
        return list(found)
    if not isinstance(given, (list, tuple, *CONTAINERS)):
        raise TypeError(
            f"blocks is {type(given).__name__}, not a list of the model's modules or the dotted path of a ModuleList"
        )
    modules = list(given)
    own = {id(m) for m in model.modules()}
    for i, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise TypeError(f"blocks[{i}] is {type(module).__name__}, not a torch.nn.Module")
        if module is model:
            raise ValueError(f"blocks[{i}] is the model itself, not one of the modules inside it")
        if id(module) not in own:
            raise ValueError(f"blocks[{i}] ({type(module).__name__}) is not a module of the model")
    return list(dict.fromkeys(modules))  # each once: a module is sharded (or compiled) once


def find_blocks(model: nn.Module, given: Any = None) -> Blocks:
    if given is not None:
        modules = given_blocks(model, given)
        return Blocks(modules, _parents(model, modules), "the pipeline's blocks")
    own = getattr(model, "blocks", None)
    if isinstance(own, CONTAINERS) and len(own):
        return Blocks(list(own), "blocks", "model.blocks")
    for find, source in ((_no_split, "_no_split_modules"), (_largest_repeated, "the largest repeated ModuleList")):
        modules = find(model)
        if modules:
            return Blocks(modules, _parents(model, modules), source)
    if isinstance(model, nn.Sequential):
        modules = [m for m in model if any(True for _ in m.parameters(recurse=False))]
        if modules:
            return Blocks(modules, "", "a Sequential's layers with weights")
    return Blocks([])


def blocks_of(model: nn.Module, given: Any = None) -> list[nn.Module]:
    return find_blocks(model, given).modules


def _no_split(model: nn.Module) -> list[nn.Module]:
    names: set[str] = set()
    for holder in (model, getattr(model, "base_model", None)):
        listed = getattr(holder, "_no_split_modules", None)
        if isinstance(listed, (list, tuple, set, frozenset)):
            names.update(n for n in listed if isinstance(n, str))
    if not names:
        return []
    found: list[nn.Module] = []
    inside: set[int] = set()  # modules within one already found: the outermost is the unit
    for module in model.modules():
        if module is not model and id(module) not in inside and type(module).__name__ in names:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def _largest_repeated(model: nn.Module) -> list[nn.Module]:
    best: list[nn.Module] = []
    best_size = 0
    for container in model.modules():  # each module once, however many names hold it
        if not isinstance(container, CONTAINERS):
            continue
        children = list(container)
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        if not all(any(True for _ in c.parameters()) for c in children):
            continue
        size = sum(p.numel() for p in container.parameters())
        if size > best_size:  # ties: the first found, the outermost
            best, best_size = children, size
    return best


def _parents(model: nn.Module, modules: list[nn.Module]) -> str:
    """Where the modules sit: their parents' dotted paths, each once."""
    names = {id(m): name for name, m in model.named_modules()}
    parents = dict.fromkeys(names.get(id(m), "?").rpartition(".")[0] for m in modules)
    shown = [p or "the model" for p in parents]
    return ", ".join(shown[:3]) + (", ..." if len(shown) > 3 else "")
