"""How a model splits into pipeline stages, by module name: `pp_stages="auto"`'s even split of the
found blocks (`auto_stages`), a given split checked (`check_stages`, `check_container`), and both
behind `split_names`. Every refusal is one line naming what is wrong; raylane.loop.distributed.pipeline_parallel
builds the stages from the names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from raylane.loop.distributed.blocks import CONTAINERS, Blocks


def _names(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules(remove_duplicate=False)}


def auto_stages(model: nn.Module, found: Blocks, n: int) -> list[list[str]]:
    """The found blocks split evenly over `n` stages (earlier stages take one more where they do not
    divide), the modules registered before the blocks on the first stage, after them on the last.
    ValueError, in one line, when the model cannot be split so."""
    kind = type(model).__name__
    if not found.modules and (lone := _lone_block(model)):  # a stack of one block is still the blocks
        raise ValueError(f"Pipeline.pp_stages = 'auto': {n} stages for the 1 block of {kind} ({lone}.0)")
    if not found.modules:
        raise ValueError(f"Pipeline.pp_stages = 'auto': no repeated blocks found in {kind} to split into stages")
    if len(found.modules) < n:
        count = len(found.modules)
        raise ValueError(f"Pipeline.pp_stages = 'auto': {n} stages for the {count} block{'s' * (count > 1)} of {kind}")
    names = _names(model)
    blocks = [names[id(b)] for b in found.modules]
    parents = {b.rpartition(".")[0] for b in blocks}
    container = parents.pop()
    if parents or not isinstance(model.get_submodule(container), CONTAINERS):
        raise ValueError(
            f"Pipeline.pp_stages = 'auto': the blocks of {kind} are not one ModuleList or Sequential; "
            "give pp_stages as lists of module names"
        )
    before: list[str] = []
    after: list[list[str]] = []  # per holder, outermost first
    path = container.split(".") if container else []
    for depth in range(len(path)):  # each module on the way from the model to the blocks' container
        holder = model.get_submodule(".".join(path[:depth]))
        prefix = "".join(f"{p}." for p in path[:depth])
        if own := [name for name, _ in holder.named_parameters(recurse=False)]:
            raise ValueError(
                f"Pipeline.pp_stages = 'auto': {prefix + own[0]!r} is a parameter of {type(holder).__name__} "
                "itself, which no stage can hold alone; move it into a module of its own"
            )
        children = [name for name, _ in holder.named_children()]
        at = children.index(path[depth])
        before += [prefix + name for name in children[:at]]
        after.append([prefix + name for name in children[at + 1 :]])
    stages = _split_container(model, container, blocks, n)
    stages[0][:0] = before
    for rest in reversed(after):  # the innermost holder's first, as the forward meets them
        stages[-1].extend(rest)
    return stages


def _lone_block(model: nn.Module) -> str | None:
    """The path of a ModuleList or Sequential of one child with parameters (a model of one block,
    which raylane.loop.distributed.blocks does not call repeated), or None."""
    for name, module in model.named_modules():
        if isinstance(module, CONTAINERS) and len(module) == 1 and any(True for _ in module.parameters()):
            return name
    return None


def _split_container(model: nn.Module, container: str, blocks: list[str], n: int) -> list[list[str]]:
    """The container's children over `n` stages: its blocks evenly (earlier stages take one more
    where they do not divide), any other child with the block before it (a Sequential's
    activations), or on the first stage."""
    base, extra = divmod(len(blocks), n)
    sizes = [base + (1 if s < extra else 0) for s in range(n)]
    stages: list[list[str]] = [[] for _ in range(n)]
    stage, taken, wanted = 0, 0, set(blocks)
    prefix = f"{container}." if container else ""
    for child in model.get_submodule(container)._modules:
        name = prefix + child
        if name in wanted:
            if taken == sizes[stage]:
                stage, taken = stage + 1, 0
            taken += 1
        stages[stage].append(name)
    return stages


def check_stages(model: nn.Module, stages: Sequence[Sequence[str]], n: int) -> list[list[str]]:
    """`stages` (lists of module names) as lists; ValueError naming what is wrong: a count other
    than `n`, a name of no module, a parameter no stage or two stages hold, a tied parameter that
    two stages hold."""
    kind = type(model).__name__
    if isinstance(stages, str) or len(stages) != n:
        got = repr(stages) if isinstance(stages, str) else f"{len(stages)} stages"
        raise ValueError(f"Pipeline.pp_stages: {got}, for the {n} stages of strategy.pp x pp_stages_per_rank")
    modules = dict(model.named_modules())
    listed = [list(s) for s in stages]
    for names in listed:
        for name in names:
            if name not in modules or not name:
                raise ValueError(f"Pipeline.pp_stages: {name!r} names no module of {kind}")
    for pname, _ in model.named_parameters():
        holders = [i for i, names in enumerate(listed) if any(is_under(pname, m) for m in names)]
        if len(holders) != 1:
            what = "no stage holds" if not holders else f"stages {holders[0]} and {holders[1]} both hold"
            raise ValueError(f"Pipeline.pp_stages: {what} the parameter {pname!r} of {kind}")
    from raylane.loop.distributed.tensor_parallel import shared_parameters

    for tied in shared_parameters(model):
        owners = {next(i for i, names in enumerate(listed) if any(is_under(t, m) for m in names)) for t in tied}
        if len(owners) > 1:
            raise ValueError(
                f"Pipeline.pp_stages: {tied[0]!r} and {tied[1]!r} are one tied parameter, which stages "
                f"{min(owners)} and {max(owners)} would hold apart (and train apart); untie them, or keep both on one stage"
            )
    return listed


def is_under(name: str, module: str) -> bool:
    """Whether `name` is the module `module` or inside it."""
    return name == module or name.startswith(module + ".")


def split_names(model: nn.Module, found: Blocks, names: Any, n: int) -> tuple[list[list[str]], str]:
    """(the module names of each of `n` stages, the blocks' container) for `names` ("auto" or
    lists); ValueError, one line, for a split that cannot work."""
    stages = auto_stages(model, found, n) if names == "auto" else check_stages(model, names, n)
    check_stages(model, stages, n)  # auto's too: ties across stages, every parameter held once
    container = _container(model, found, stages)
    check_container(model, stages, container)
    return stages, container


def check_container(model: nn.Module, stages: list[list[str]], container: str) -> None:
    """Every child of the blocks' container on one stage: iterated on every stage, an activation
    between blocks that no stage holds would run twice."""
    prefix = f"{container}." if container else ""
    listed = {name for names in stages for name in names}
    for child in model.get_submodule(container)._modules:
        if prefix + child not in listed:
            raise ValueError(f"Pipeline.pp_stages: {prefix + child!r}, between the blocks, is on no stage")


def _container(model: nn.Module, found: Blocks, stages: list[list[str]]) -> str:
    """The dotted path of the blocks' container: the found blocks', or the first stage's last name's parent."""
    names = _names(model)
    if found.modules:
        return names[id(found.modules[0])].rpartition(".")[0]
    return stages[0][-1].rpartition(".")[0]
