"""What a checkpoint holds of a rank's model and optimizer: their state dicts as torch's
distributed-checkpoint (DCP) API gives them, keyed by parameter name, whole on every rank
(`replicated`: DDP, one process) or a shard of them (FSDP's and tensor parallelism's DTensors,
or a `partial` model's own parameters: a pipeline stage's). Written by
raylane.loop.checkpoint.writing, read back by raylane.loop.checkpoint.loading.

The optimizer's state is written flat (`flat_optim`): every value keyed by its parameter's name,
its group's hyperparameters too (`param_groups.<name>.lr`), as torch's
`flatten_optimizer_state_dict` writes it. Groups keyed by index (`param_groups.0.lr`) collide
when ranks hold different parameters (pipeline stages: each has its own group 0, and DCP keeps
one rank's), and the others would come back without their hyperparameters (issue 49's trap e);
by name, a checkpoint is the same whatever layout wrote it, and loads into any other."""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import torch

from raylane.loop.checkpoint.aliases import aliases, without_aliases
from raylane.loop.checkpoint.frozen import saved_part

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
    each tensor once (under its canonical name: raylane.loop.checkpoint.aliases), and without the frozen
    base of a model trained on one (raylane.loop.checkpoint.frozen)."""
    model_sd, optim_sd = dcp().state_dict.get_state_dict(model, optimizer)
    return {"model": saved_part(model, without_aliases(model_sd, aliases(model))), "optim": optim_sd}


def replicated(model: torch.nn.Module) -> bool:
    """Every rank holds the whole state (DDP, one process), not a shard of it (FSDP's DTensors,
    or a partial model's). It depends on the model alone, so every rank reaches the same answer."""
    return not partial(model) and not any(hasattr(p, "_local_tensor") for p in model.parameters())


PARTIAL = "_raylane_partial"


def mark_partial(model: torch.nn.Module) -> torch.nn.Module:
    """Marks `model` as a part of the whole that differs from rank to rank, under the whole
    model's parameter names (a pipeline stage): its checkpoint is written by every rank, each
    its own parameters, and loads into any layout."""
    setattr(model, PARTIAL, True)
    return model


def partial(model: torch.nn.Module) -> bool:
    return bool(getattr(model, PARTIAL, False))


FLAT = "flat"  # the manifest's "optim_state" for a checkpoint whose optimizer state is flat


def is_flat(optim_state: dict[str, Any]) -> bool:
    """An optimizer state dict in the flat form (`flat_optim`), not torch's nested one."""
    return "state" not in optim_state and "param_groups" not in optim_state


def flat_optim(optim_state: dict[str, Any]) -> dict[str, Any]:
    """torch's nested optimizer state dict (`state` and `param_groups`, keyed by parameter name
    as DCP's get_state_dict gives it) in the flat form of torch's `flatten_optimizer_state_dict`:
    `state.<name>.<key>` and `param_groups.<name>.<hyperparameter>`. Nothing is copied or
    changed in the original (a staged copy may be reused by the next save)."""
    if is_flat(optim_state):
        return optim_state
    flat: dict[str, Any] = {}

    def put(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                put(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    for name, values in optim_state.get("state", {}).items():
        put(f"state.{name}", values)
    for group in optim_state.get("param_groups", ()):
        settings = {k: v for k, v in group.items() if k != "params"}
        for name in group["params"]:
            for k, v in settings.items():
                flat[f"param_groups.{name}.{k}"] = v
    return flat


def nested_optim(flat: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """A flat optimizer state (`flat_optim`) back in torch's nested form, grouped as `template`
    (this run's optimizer's nested state dict) groups its parameters: its state's keys are the
    template's, each group's hyperparameters those its parameters were saved with. KeyError
    naming the first key the flat state lacks (torch's own unflattening would leave it empty)."""
    state = {
        name: {k: _saved(flat, f"state.{name}.{k}", v) for k, v in values.items()}
        for name, values in template.get("state", {}).items()
    }
    groups = []
    for group in template.get("param_groups", ()):
        names = list(group["params"])
        settings = {k: v for k, v in group.items() if k != "params"}  # an empty group's are its own
        if names:
            saved = next((n for n in names if f"param_groups.{n}.lr" in flat), names[0])
            settings = {k: _saved(flat, f"param_groups.{saved}.{k}", v) for k, v in settings.items()}
        groups.append({**settings, "params": names})
    return {"state": state, "param_groups": groups}


def _saved(flat: dict[str, Any], key: str, like: Any) -> Any:
    """The value saved under `key`, nested like `like` (an optimizer whose state is a dict)."""
    if isinstance(like, dict):
        return {k: _saved(flat, f"{key}.{k}", v) for k, v in like.items()}
    if key not in flat:
        raise KeyError(key)
    return flat[key]


def grouped(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat optimizer state (`flat_optim`) in torch's nested form without the model at hand, for
    readers of a checkpoint: a group per set of hyperparameters (in the order the groups were
    saved; two groups saved with the same ones come back as one), each parameter's state a dict."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if key.startswith("param_groups."):
            name, _, hyper = key.removeprefix("param_groups.").rpartition(".")
            groups.setdefault(name, {})[hyper] = value
    state: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith("state."):
            rest = key.removeprefix("state.")
            name = max((n for n in groups if rest.startswith(f"{n}.")), key=len, default=rest.rpartition(".")[0])
            state.setdefault(name, {})[rest.removeprefix(f"{name}.")] = value
    by_settings: dict[str, dict[str, Any]] = {}
    for name, settings in groups.items():
        group = by_settings.setdefault(repr(sorted(settings.items())), {**settings, "params": []})
        group["params"].append(name)
    return {"state": state, "param_groups": list(by_settings.values())}


def regrouped(flat: dict[str, Any], template: dict[str, Any], names: dict[str, str]) -> tuple[int, int] | None:
    """(groups there, groups here) when a flat optimizer state groups the parameters otherwise
    than `template` (this run's nested state) does; None when alike. Groups are told apart by
    their hyperparameters (what the flat form keeps of them), on each side: a run whose lr
    changed is grouped alike, one whose norms stopped decaying (their own group) is not.
    `names`: alias -> canonical."""
    there: dict[str, tuple[str, ...]] = {}
    for key, value in flat.items():
        if key.startswith("param_groups."):
            name, _, hyper = key[len("param_groups.") :].rpartition(".")
            there[names.get(name, name)] = (*there.get(names.get(name, name), ()), f"{hyper}={value!r}")
    here: dict[str, tuple[str, ...]] = {}
    for group in template.get("param_groups", ()):
        settings = tuple(f"{k}={v!r}" for k, v in sorted(group.items()) if k != "params")
        here.update((names.get(n, n), settings) for n in group["params"])
    pairs = {(here[n], tuple(sorted(there[n]))) for n in here if n in there}
    count_here, count_there = len({h for h, _ in pairs}), len({t for _, t in pairs})
    if len(pairs) == count_here == count_there:  # one group there for each group here
        return None
    return count_there, count_here


def scheduler_state_for(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An LR scheduler's saved state (rank 0's, in the train state) fitted to this optimizer's
    groups, loaded already: at another layout their number may differ (a pipeline stage holds
    some of the model's groups), and each group's initial and current lr come with the
    optimizer's state, by parameter name. What stays the scheduler's own is its position."""
    groups = optimizer.param_groups
    state = dict(saved)
    if "base_lrs" in state and all("initial_lr" in g for g in groups):
        state["base_lrs"] = [g["initial_lr"] for g in groups]
    if "_last_lr" in state:
        state["_last_lr"] = [g["lr"] for g in groups]
    for key in ("lr_lambdas", "lr_lambda"):  # LambdaLR's and MultiplicativeLR's: None for a function
        if isinstance(state.get(key), list) and len(state[key]) != len(groups):
            state[key] = [state[key][0] if state[key] else None] * len(groups)
    return state


def model_shapes(model_state: dict[str, Any]) -> dict[str, list[int]]:
    """Name -> full shape (a shard's global one) of every tensor of a model state dict."""
    return {k: list(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}
