"""Hugging Face models in raylane (`pip install 'raylane[hf]'`): the shipped `hf` pipeline is built
on these, and a pipeline of your own can be too (docs/hf.md).

- `Config`, `ModelSection`, `DataSection`: the config of a fine-tune (`model.name_or_path`,
  `model.task`, `data.text_column`, ...), checked before anything starts.
- `pipeline(cfg, train=..., eval=...)`: the `raylane.Pipeline` of a fine-tune, from files or from
  `datasets.Dataset`s your `build(cfg)` hands over.
- `file_source(cfg, paths, key)`: the `raylane.FileSource` of a fine-tune's files, tokenized where
  they are read (what a streaming pipeline's `sources(cfg)` returns; pipelines/hf.py).
- `empty_model(path, task)` and `load_pretrained(model, path)`: a model built on the meta device
  and its pretrained weights, read on rank 0 only and broadcast (for `Pipeline(init_weights=...)`).
- `tp_plan(model, sequence_parallel)`: the model's own tensor-parallel plan (transformers'), as
  torch's styles, its LoRA adapter split with its layers (for `Pipeline(tp_plan=...)`).
- `raylane.hf.lora`: LoRA through peft (`LoraSection`, `apply_lora`, `check_lora`).
- `raylane.hf.export`: a checkpoint as a `save_pretrained` folder (`raylane export --format hf`).

Importing raylane.hf imports neither torch nor transformers. Its other modules (build, data,
weights, ...) are internal; `__all__`, `raylane.hf.lora` and `raylane.hf.export` are public."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from raylane.hf.config import Config, DataSection, ModelSection

# tests/unit/test_public_api.py holds this list too: a name that disappears from it fails there.
__all__ = [
    "Config",
    "DataSection",
    "ModelSection",
    "empty_model",
    "file_source",
    "load_pretrained",
    "pipeline",
    "tp_plan",
]

_LAZY = {
    "pipeline": "raylane.hf.build",
    "empty_model": "raylane.hf.weights",
    "load_pretrained": "raylane.hf.weights",
    "file_source": "raylane.hf.data",
    "tp_plan": "raylane.hf.tensor_parallel",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raylane.hf' has no attribute {name!r}")
