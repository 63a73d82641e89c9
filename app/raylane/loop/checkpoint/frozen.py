"""Models trained on a frozen base (LoRA, say): a checkpoint of such a run holds the trainable
parameters, the buffers, the optimizer's state and the loop's state, not the base weights,
which the pipeline loads again from where they came from. The model carries a record of that
base (`set_base`: its path, a fingerprint of its files and one of its tokenizer's); the
checkpoint's manifest keeps it, and a load on a model whose base differs is refused naming both.

Any model may also carry a record of the tokenizer its inputs were made with (`set_tokenizer`,
the hf pipeline's, LoRA or not): a checkpoint is only worth resuming with the same token ids,
and a tokenizer retrained in place keeps its path. Nothing here imports torch at module level:
the prechecks compute fingerprints before torch starts."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

_ATTR = "_raylane_base"
# Read whole into the fingerprint: small files that say what the weights are.
_DESCRIBING = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")
_SAMPLE = 1 << 20  # bytes read at each end of a weights file
_TOKENIZER_ATTR = "_raylane_tokenizer"
# What a save_pretrained tokenizer is made of (transformers' file names: the fast tokenizer, the
# slow ones' vocabularies and merges, sentencepiece models, the special and added tokens).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)
_TOKENIZER_SUFFIXES = (".model", ".tiktoken")  # tokenizer.model, spiece.model, ...


def fingerprint(path: str | os.PathLike) -> str | None:
    """A cheap identity of a `save_pretrained` folder: SHA-256 of its config and weights index,
    and of the name, size, first and last MiB of every weights file (milliseconds, whatever the
    model's size; the sizes alone would not tell a retrained base of the same shape). None for
    what is not a local folder (a hub id): it is not checked."""
    folder = Path(path).expanduser() if str(path) else None
    if folder is None or not folder.is_dir():
        return None
    digest = hashlib.sha256()
    for name in _DESCRIBING:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes() + b"\0")
    for file in sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in _WEIGHTS):
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(_SAMPLE))
            f.seek(max(size - _SAMPLE, 0))
            digest.update(f.read(_SAMPLE))
    return digest.hexdigest()


def tokenizer_fingerprint(path: str | os.PathLike) -> str | None:
    """SHA-256 of the tokenizer files of a `save_pretrained` folder, read whole (they are small);
    None where there is no folder or no tokenizer file (a hub id: not checked)."""
    folder = Path(path).expanduser() if str(path) else None
    if folder is None or not folder.is_dir():
        return None
    files = sorted(
        p for p in folder.iterdir() if p.is_file() and (p.name in _TOKENIZER_FILES or p.suffix in _TOKENIZER_SUFFIXES)
    )
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def _unwrapped(model: Any) -> Any:
    """The user's module under DDP's wrapper and torch.compile's (FSDP2 keeps the module itself)."""
    for attr in ("module", "_orig_mod"):
        inner = getattr(model, attr, None)
        if inner is not None and type(model).__name__ in ("DistributedDataParallel", "OptimizedModule"):
            model = inner
    return model


def set_base(model: Any, base: dict[str, Any]) -> None:
    """Mark `model` as trained on a frozen base: {"path", "fingerprint", and optionally "key",
    the config key naming the path}. Its checkpoints then hold only what trains (and buffers).
    The fingerprint of the tokenizer saved with the base ("tokenizer") is added when not given."""
    if "tokenizer" not in base and base.get("path"):
        base = {**base, "tokenizer": tokenizer_fingerprint(base["path"])}
    object.__setattr__(model, _ATTR, {k: v for k, v in base.items() if v is not None})


def frozen_base(model: Any, path: str | os.PathLike, *, key: str | None = None) -> Any:
    """Public (`raylane.frozen_base`): mark `model` as trained on the frozen base whose
    `save_pretrained`-style files are in `path`, with their fingerprint; `key`, the config key
    naming `path`, lets a relaunch on another base exit 2 naming it. Returns `model`.
    `raylane.hf.lora.apply_lora` calls it for a LoRA adapter."""
    set_base(model, {"path": str(path), "fingerprint": fingerprint(path), "key": key})
    return model


def base_of(model: Any) -> dict[str, Any] | None:
    """The record `set_base` left on `model` (wrapped or not), or None."""
    return getattr(_unwrapped(model), _ATTR, None)


def set_tokenizer(model: Any, tokenizer: dict[str, Any]) -> None:
    """Record on `model` the tokenizer its inputs are made with: {"path", "fingerprint"
    (tokenizer_fingerprint), and optionally "key", the config key naming the path}. Its
    checkpoints keep it, and a resume with another tokenizer is refused naming both."""
    object.__setattr__(_unwrapped(model), _TOKENIZER_ATTR, {k: v for k, v in tokenizer.items() if v is not None})


def tokenizer_of(model: Any) -> dict[str, Any] | None:
    return getattr(_unwrapped(model), _TOKENIZER_ATTR, None)


def records_of(model: Any) -> dict[str, Any]:
    """What a checkpoint's manifest records of the files the model depends on but the checkpoint
    does not hold: {"base": set_base's record, "tokenizer": set_tokenizer's}, those it has."""
    return {k: v for k, v in (("base", base_of(model)), ("tokenizer", tokenizer_of(model))) if v}


def _plain(name: str) -> str:
    return name.replace("_orig_mod.", "").removeprefix("module.")


def trainable_names(model: Any) -> set[str]:
    """The names (as DCP's state dicts spell them) of the parameters that train."""
    return {_plain(n) for n, p in model.named_parameters() if p.requires_grad}


def frozen_names(model: Any) -> set[str]:
    return {_plain(n) for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def saved_part(model: Any, model_state: dict[str, Any]) -> dict[str, Any]:
    """What of `model_state` a checkpoint holds: all of it, or, for a model on a frozen base,
    everything but the frozen parameters."""
    if base_of(model) is None:
        return model_state
    frozen = frozen_names(model)
    return {k: v for k, v in model_state.items() if k not in frozen}


def mismatch(path: str | os.PathLike, manifest: dict[str, Any], model: Any) -> str | None:
    """Why the checkpoint at `path` (its `manifest`) cannot be loaded into `model`: its tokenizer
    changed (where both record one), or its base did (base_mismatch). None if fine."""
    recorded, here = manifest.get("tokenizer"), tokenizer_of(model)
    if recorded and here and recorded.get("fingerprint") and here.get("fingerprint"):
        if recorded["fingerprint"] != here["fingerprint"]:
            return (
                f"checkpoint {path} was trained with the tokenizer {describe(recorded)}; this run's is {describe(here)}"
            )
    return base_mismatch(path, manifest.get("base"), model)


def base_mismatch(path: str | os.PathLike, recorded: dict[str, Any] | None, model: Any) -> str | None:
    """Why the checkpoint at `path`, whose manifest records `recorded` as its base, cannot be
    loaded into `model`: it has another base (its weights, or its tokenizer where both records
    have one: a checkpoint from before tokenizers were recorded has none), or one has a base and
    the other not. None if fine."""
    here = base_of(model)
    if recorded is None and here is None:
        return None
    if recorded is None or here is None:
        return (
            f"checkpoint {path} holds {'a whole model' if recorded is None else 'an adapter only'}, and this "
            f"run's model {'is trained on a frozen base' if recorded is None else 'is whole'}"
        )
    tokenizer = tokenizer_changed(recorded, here.get("tokenizer"))
    if recorded.get("fingerprint") == here.get("fingerprint") and not tokenizer:
        return None
    return (
        f"checkpoint {path} was trained on base {describe(recorded, tokenizer)}; this run's base is "
        f"{describe(here, tokenizer)}"
    )


def tokenizer_changed(recorded: dict[str, Any], now: str | None) -> bool:
    """A base record's tokenizer fingerprint differs from `now` (both known)."""
    was = recorded.get("tokenizer")
    return bool(was and now and was != now)


def describe(base: dict[str, Any], tokenizer: bool = False) -> str:
    """`base` (or a tokenizer's record) for a message: its path and fingerprint; `tokenizer`: a
    base's tokenizer's fingerprint too."""
    fp, tok = base.get("fingerprint"), base.get("tokenizer")
    also = f", its tokenizer's {tok[:12] if tok else 'none'}" if tokenizer else ""
    return f"{base.get('path')!r} (fingerprint {fp[:12] if fp else 'none'}{also})"
