"""Tiny models of the architecture families transformers ships configs for, made from its own
config classes with random weights and saved with `save_pretrained` (as transformers 5 writes
them: a mixture of experts one expert at a time, Mixtral under its legacy `block_sparse_moe.*.w1`
names, both fused again when transformers loads them). Test-only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SMALL = {"vocab_size": 128, "max_position_embeddings": 64}
DECODER = {**SMALL, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def qwen2_moe(**extra: Any):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        **{
            **DECODER,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            **extra,
        }
    )


def mixtral(**extra: Any):
    from transformers import MixtralConfig

    return MixtralConfig(
        **{**DECODER, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2, **extra}
    )


def llama(**extra: Any):
    from transformers import LlamaConfig

    return LlamaConfig(**{**DECODER, "intermediate_size": 64, **extra})


def gpt2(**extra: Any):
    from transformers import GPT2Config

    return GPT2Config(
        **{"vocab_size": 128, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, **extra},
        bos_token_id=0,
        eos_token_id=0,
    )


def bert(**extra: Any):
    from transformers import BertConfig

    return BertConfig(
        **{**SMALL, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
        | extra
    )


CONFIGS = {"llama": llama, "gpt2": gpt2, "qwen2_moe": qwen2_moe, "mixtral": mixtral, "bert": bert}


def save(folder: Path, family: str, seed: int = 0, *, max_shard_size: str | None = None, **extra: Any) -> Path:
    """A `family` model with random weights (seeded) saved in `folder`: a causal LM, except BERT,
    saved as the bare encoder (`BertModel`, no head: a classifier's is new)."""
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = CONFIGS[family](**extra)
    model = (AutoModel if family == "bert" else AutoModelForCausalLM).from_config(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def ids(batch: int = 2, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, SMALL["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))
