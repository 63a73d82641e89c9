"""Pretrained weights read once per node, not once per rank.

Every rank builds the model on the meta device (`empty_model`: shapes, no memory; buffers real);
raylane parallelizes it (DDP, or FSDP2 per block) and gives it storage (`raylane.loop.parallel.
materialize`); then `load_pretrained` runs on every rank: rank 0 alone reads the safetensors
files, and torch's `set_model_state_dict(..., broadcast_from_rank0=True)` sends each tensor to
the other ranks, straight into their DDP replica or their FSDP2 shard. Peak host memory per rank
is one copy of the weights on rank 0 and one shard elsewhere, where a per-rank `from_pretrained`
holds a whole copy on every rank."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raylane.hf.config import AUTO_CLASSES, weight_files

log = logging.getLogger("raylane")


def empty_model(path: str | Path, task: str = "causal-lm", **config: Any) -> nn.Module:
    """The model saved in `path` (a save_pretrained folder) for `task`, built on the meta device:
    parameters without storage, buffers real (rotary frequencies are in no state dict). `config`:
    overrides of the saved config (num_labels=3, say)."""
    import transformers
    from accelerate import init_empty_weights

    auto = getattr(transformers, AUTO_CLASSES[task])
    model_config = transformers.AutoConfig.from_pretrained(path, **config)
    with init_empty_weights(include_buffers=False):
        model = auto.from_config(model_config)
    model.tie_weights()  # accelerate's meta parameters come untied: one tensor under both names again
    return model


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files, on the CPU (rank 0 only calls it)."""
    from safetensors import torch as safetensors_torch  # by module: tests count its calls

    full: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        full.update(safetensors_torch.load_file(str(file)))
    return full


def load_pretrained(model: nn.Module, path: str | Path) -> None:
    """Loads the weights saved in `path` into `model`, on every rank (a collective): rank 0 reads
    the files, the other ranks receive their part by broadcast. Call it after raylane has
    parallelized the model (a pipeline's `init_weights`). Weights the files lack (a new
    classification head) are drawn as transformers does, normal(0, initializer_range) and zero
    biases, on rank 0; tensors the model lacks (a causal LM's head under a classifier) are left out."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = getattr(model, "module", model)  # DDP's wrapper: its module's names
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if distributed else 0
    full = _full_state(model, path) if rank == 0 else {}
    if not distributed:
        model.load_state_dict(full)
        return
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


# A peft model's names for its base's tensors: "base_model.model." before, ".base_layer" inside
# an adapted layer.
_PEFT_PREFIX = "base_model.model."


def _file_name(name: str) -> str:
    """The name under which the base's files hold the tensor `name` of the (peft) model."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def _adapter_init(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A LoRA adapter's tensor as peft initializes it: lora_A as nn.Linear (Kaiming uniform),
    lora_B zeros, so that the adapted model starts as its base. None for any other name."""
    if ".lora_B." in name:
        return torch.zeros(shape, dtype=dtype)
    if ".lora_A." in name:
        weight = torch.empty(shape, dtype=dtype)
        nn.init.kaiming_uniform_(weight, a=5**0.5)
        return weight
    return None


def _full_state(model: nn.Module, path: str | Path) -> dict[str, torch.Tensor]:
    """The model's whole state dict from the files: every key the model has, tied names given
    the one tensor, a LoRA adapter as peft starts it, other missing weights initialized."""
    names = list(model.state_dict())
    # A peft model's names (by name, not class: FSDP2 makes the class one of its own).
    peft = any(name.startswith(_PEFT_PREFIX) for name in names)
    saved = {(_PEFT_PREFIX + k if peft else k): v for k, v in read_weights(path).items()}
    saved.update(
        {
            name: saved[_PEFT_PREFIX + _file_name(name)]
            for name in names
            if ".base_layer." in name and _PEFT_PREFIX + _file_name(name) in saved
        }
    )
    std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
    ties = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        ties.setdefault(id(p), []).append(name)
    full, drawn = {}, []
    for name, value in model.state_dict().items():
        if name in saved:
            full[name] = saved[name]
            continue
        alias = next((n for group in ties.values() if name in group for n in group if n in saved), None)
        if alias is not None:
            full[name] = saved[alias]
            continue
        shape = tuple(value.shape)  # a DTensor's is the whole tensor's
        if (adapter := _adapter_init(name, shape, value.dtype)) is not None:
            full[name] = adapter
            continue
        fresh = torch.zeros(shape, dtype=value.dtype)
        if name.endswith("weight") and len(shape) > 1:
            fresh.normal_(0.0, std)
        elif name.endswith("weight"):
            fresh.fill_(1.0)  # a norm's scale
        full[name] = fresh
        drawn.append(name)
    if drawn:
        log.info("pretrained weights in %s have no %s: initialized", path, ", ".join(drawn))
    return full
