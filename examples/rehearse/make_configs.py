"""Writes the config.json (no weights) of Llama-2-7B and of Mixtral-8x7B, as their model cards on
the Hugging Face hub give them, into llama-2-7b/ and mixtral-8x7b/ beside this file (or under OUT)."""

from __future__ import annotations

import sys
from pathlib import Path


def write(out: Path) -> dict[str, Path]:
    from transformers import LlamaConfig, MixtralConfig

    configs = {
        "llama-2-7b": LlamaConfig(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            vocab_size=32000,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        "mixtral-8x7b": MixtralConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            max_position_embeddings=32768,
            rope_theta=1e6,
            tie_word_embeddings=False,
        ),
    }
    written = {}
    for name, config in configs.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        config.to_json_file(str(folder / "config.json"))
        written[name] = folder
    return written


if __name__ == "__main__":
    for name, folder in write(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)).items():
        print(f"{name}: {folder / 'config.json'}")
