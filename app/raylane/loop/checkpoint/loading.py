"""Loading a committed checkpoint into this run's model and optimizer, at any world size and
under any layout (DDP, FSDP, tensor parallelism, a pipeline stage, one process), whichever wrote
it (raylane.loop.checkpoint.writing): parameters are named alike in every layout, and so is the
optimizer's state, flat (raylane.loop.checkpoint.state.flat_optim; checkpoints from before it,
nested, still load). A checkpoint that does not fit (another model, another grouping of the
optimizer's parameters) is refused with one line naming the first difference, on every rank,
rather than loaded halfway or failing at the next step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from raylane.errors import RaylaneError
from raylane.loop.checkpoint.agree import describe
from raylane.loop.checkpoint.aliases import aliases, unexplained, without_aliases
from raylane.loop.checkpoint.frozen import base_of, frozen_names, mismatch, saved_part
from raylane.loop.checkpoint.manifest import MANIFEST_FILE, read_manifest
from raylane.loop.checkpoint.rng import rng_file, set_rng_state
from raylane.loop.checkpoint.state import (
    FLAT,
    STATE_FILE,
    dcp,
    flat_optim,
    is_flat,
    model_shapes,
    nested_optim,
    partial,
    regrouped,
    replicated,
)


class CheckpointLoadError(RaylaneError, RuntimeError):
    """A committed checkpoint that this model and optimizer cannot load; raised on every rank."""


class RunLayout(Protocol):
    """This run's layout as a load compares it with a checkpoint's (raylane.loop.distributed.
    layout.Layout: the one reader of the manifest's record)."""

    def same_as(self, record: Any) -> bool: ...


def load(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int | None = None,
    hooks: dict[str, Any] | None = None,
    layout: RunLayout | None = None,
) -> dict[str, Any]:
    """Collective. Loads in place (resharding if the world size changed); returns the train state.
    With `rank`, also restores that rank's random generators when the layout is unchanged
    (`layout`: this run's, which reads the manifest's record of the saved one; else the world size).
    `hooks`: the hooks' states by key as they are now (raylane.loop.protocols.hooks), which a sharded
    checkpoint loads into in place; the train state's "hook_states" holds what was saved of them.

    A sharded checkpoint's DCP `.metadata` is a pickle: only load checkpoints this project wrote
    (trusted storage). A replicated one's `state.pt` is read with `weights_only=True`."""
    if not (Path(path) / MANIFEST_FILE).exists():
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no {MANIFEST_FILE})")
    names = aliases(model)
    model_sd, optim_sd = dcp().state_dict.get_state_dict(model, optimizer)
    model_sd = saved_part(model, without_aliases(model_sd, names))
    manifest = read_manifest(path)
    if problem := mismatch(path, manifest, model):
        raise CheckpointLoadError(problem)
    check_shapes(path, manifest.get("shapes"), model_sd, names, part=partial(model))
    groups = group_layout(optim_sd, names)  # before a DCP load replaces them with the checkpoint's
    whole = (Path(path) / STATE_FILE).exists()
    if whole:
        state = _read_whole(path, model, names, hooks)
    else:
        saved_hooks = set((manifest.get("train_state") or {}).get("hooks") or ())
        flat = manifest.get("optim_state") == FLAT
        state = {"model": model_sd, "optim": flat_optim(optim_sd) if flat else optim_sd}
        if wanted := {k: v for k, v in (hooks or {}).items() if k in saved_hooks}:
            state["hooks"] = wanted
        _read_sharded(path, state, None if flat else groups, rank)
    rngs = state.pop("rng", None)  # a replicated state's: every rank's generators
    state["optim"] = _nested(path, state["optim"], optim_sd, names)
    _check_groups(path, groups, group_layout(state["optim"], names))
    # Whole tensors into a sharded model (a DDP run resumed under FSDP): each rank keeps its shard.
    _set_state(path, model, optimizer, state, names, full=whole and not replicated(model))
    train_state = manifest["train_state"]
    if state.get("hooks"):
        train_state = {**train_state, "hook_states": state["hooks"]}
    _restore_rng(path, rank, train_state, rngs, layout)
    return train_state


def _nested(path: str | os.PathLike, optim: dict[str, Any], template: dict[str, Any], names: dict[str, str]):
    """The checkpoint's optimizer state in torch's nested form, grouped as this run's optimizer
    (`template`) groups its parameters, with the hyperparameters they were saved with."""
    if not is_flat(optim):
        return optim
    if counts := regrouped(optim, template, names):
        _check_groups(path, [()] * counts[1], counts[0])
    try:
        return nested_optim(optim, template)
    except KeyError as exc:
        raise CheckpointLoadError(
            f"checkpoint {path} does not fit this run's optimizer: optim.{exc.args[0]} is absent there "
            "(optim.name or its state changed); keep them to resume it, or start a fresh run with another run.name"
        ) from None


def _read_whole(
    path: str | os.PathLike, model: torch.nn.Module, names: dict[str, str], hooks: dict[str, Any] | None
) -> dict[str, Any]:
    """A replicated checkpoint's `state.pt`, its tensors whole (its "rng": every rank's generators)."""
    state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
    state["model"] = without_aliases(state["model"], names)  # an earlier version saved them too
    if not replicated(model) and state.get("hooks") and hooks:
        state["hooks"] = _sharded_like(hooks, state["hooks"])  # the hooks' own tensors, sharded as they are now
    return state


def _read_sharded(
    path: str | os.PathLike, state: dict[str, Any], groups: list[tuple[str, ...]] | None, rank: int | None
) -> None:
    """A sharded checkpoint, read by DCP into `state` (this run's state dicts) in place.
    `groups`: this run's optimizer's, for a checkpoint whose state is nested (by group index)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if groups is not None:
        _check_groups(path, groups, _saved_group_count(path))
    try:
        dcp().load(state, checkpoint_id=str(path))
    except CheckpointException as exc:  # a BaseException, which the launchers' handlers would miss
        raise CheckpointLoadError(f"checkpoint {path} cannot be loaded ({describe(exc, rank or 0)})") from None


def _set_state(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    names: dict[str, str],
    *,
    full: bool,
) -> None:
    """`state` into the model and optimizer; `full`: its tensors are whole, the model sharded."""
    state_dict = dcp().state_dict
    # Not strict: the aliases are loaded through their canonical tensor; what else is missing is
    # checked below.
    options = state_dict.StateDictOptions(full_state_dict=full, strict=False)
    if full and not state["optim"].get("state"):
        # Whole tensors into a sharded model, and an optimizer with no state (SGD without
        # momentum): torch's full-state-dict load needs a state tensor to find the device, so
        # the model is loaded alone and the groups' settings copied.
        loaded = state_dict.set_model_state_dict(model, state["model"], options=options)
        for group, saved in zip(optimizer.param_groups, state["optim"].get("param_groups") or (), strict=False):
            group.update({k: v for k, v in saved.items() if k != "params"})
    else:
        loaded = state_dict.set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )
    # A frozen base is not in the checkpoint: its weights are the ones the pipeline loaded.
    frozen = frozen_names(model) if base_of(model) is not None else set()
    missing = [k for k in unexplained(loaded.missing_keys, names) if k not in frozen]
    unexpected = sorted(loaded.unexpected_keys)
    if missing or unexpected:
        name, where = (missing[0], "there") if missing else (unexpected[0], "here")
        raise CheckpointLoadError(
            f"checkpoint {path} does not fit this run's model: {name} is absent {where} "
            "(the config or the pipeline changed the model); start a fresh run with another run.name"
        )


def _restore_rng(
    path: str | os.PathLike,
    rank: int | None,
    train_state: dict[str, Any],
    rngs: list[str] | None,
    layout: RunLayout | None,
) -> None:
    """`rank`'s random generators as saved, when the layout (or without one, the world size) is
    the one that saved them (a replicated checkpoint's from `rngs`, a sharded one's from its own
    file): rank r of another layout is another part of the model and of the data."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if rank is None or train_state.get("world_size") != world_size:
        return
    if layout is not None and not layout.same_as(train_state.get("layout")):
        return
    rng = Path(path) / rng_file(rank)
    if rngs is not None and rank < len(rngs):
        set_rng_state(json.loads(rngs[rank]))
    elif rng.exists():
        set_rng_state(json.loads(rng.read_text()))


def check_shapes(
    path: str | os.PathLike,
    recorded: dict[str, list[int]] | None,
    model_state: dict[str, Any],
    names: dict[str, str] | None = None,
    *,
    part: bool = False,
) -> None:
    """The model about to load `path` has the parameters its manifest recorded (when it did):
    one line naming the first that differs, rather than DCP's error from every rank. Canonical
    names are compared: `names` (alias -> canonical) leaves out the aliases an earlier version
    recorded too. `part`: the model is a part of the whole (a pipeline stage), whose own
    parameters are checked."""
    if not recorded:
        return
    names = names or {}
    recorded = {k: v for k, v in recorded.items() if k not in names}
    live = {k: v for k, v in model_shapes(model_state).items() if k not in names}
    for name in sorted(set(live) if part else set(recorded) | set(live)):
        if recorded.get(name) != live.get(name):
            was = "absent" if name not in recorded else f"shape {recorded[name]}"
            now = "absent" if name not in live else f"shape {live[name]}"
            raise CheckpointLoadError(
                f"checkpoint {path} does not fit this run's model: {name} is {was} there and {now} here "
                "(the config or the pipeline changed the model); start a fresh run with another run.name"
            )


def group_layout(optim_state: dict[str, Any], names: dict[str, str]) -> list[tuple[str, ...]]:
    """An optimizer state's parameter groups, as the canonical names of their parameters."""
    return sorted(tuple(sorted({names.get(p, p) for p in g["params"]})) for g in optim_state.get("param_groups", ()))


def _saved_group_count(path: str | os.PathLike) -> int:
    """The parameter groups of a sharded checkpoint's optimizer, from DCP's metadata (its keys
    are `optim.param_groups.<index>.<key>`)."""
    keys = dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return len({k.split(".")[2] for k in keys if k.startswith("optim.param_groups.")})


def _check_groups(path: str | os.PathLike, here: list[tuple[str, ...]], there: list[tuple[str, ...]] | int) -> None:
    """The checkpoint's optimizer groups its parameters as this run's does (`there`: the groups,
    or only their count): torch would load another grouping without a word and fail at the next
    step, or train with the wrong group's settings."""
    if there == (len(here) if isinstance(there, int) else here):
        return
    count = there if isinstance(there, int) else len(there)
    raise CheckpointLoadError(
        f"checkpoint {path} does not fit this run's optimizer: it groups the parameters differently ({count} "
        f"parameter group{'s' if count != 1 else ''} there, {len(here)} here: optim.weight_decay or "
        "optim.decay_norm_and_bias changed, or the pipeline's optimizer); keep them to resume it, or start a "
        "fresh run with another run.name"
    )


def _sharded_like(template: Any, full: Any) -> Any:
    """`full` (whole tensors, from a replicated checkpoint) with each tensor that `template`
    holds as a DTensor distributed the same way: a hook's state saved under DDP, resumed under
    FSDP (each rank keeps its shard)."""
    if isinstance(full, dict) and isinstance(template, dict):
        return {k: _sharded_like(template.get(k), v) for k, v in full.items()}
    if isinstance(full, (list, tuple)) and isinstance(template, (list, tuple)) and len(full) == len(template):
        return type(full)(_sharded_like(t, v) for t, v in zip(template, full, strict=True))
    if isinstance(full, torch.Tensor) and hasattr(template, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(template.device), template.device_mesh, template.placements)
    return full
