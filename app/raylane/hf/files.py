"""What a `save_pretrained` folder holds and which transformers class loads it for a task: shared
by the config's checks (raylane.hf.config), the hub's cache (raylane.hf.hub) and the loader
(raylane.hf.weights), which the config's checks call. No torch or transformers is imported here."""

from __future__ import annotations

import json
from pathlib import Path

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
# model.task -> the transformers Auto class that loads it.
AUTO_CLASSES = {"causal-lm": "AutoModelForCausalLM", "sequence-classification": "AutoModelForSequenceClassification"}


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a save_pretrained folder (one, or the shards its index lists)."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return [path / WEIGHTS]
    if (path / WEIGHTS_INDEX).is_file():
        shards = json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"].values()
        return [path / name for name in sorted(set(shards))]
    return []
