"""A test pipeline: a tiny LLaMA-architecture causal LM from a `save_pretrained` folder
(`model.name_or_path`), fine-tuned in full or with LoRA (`lora:`) on random token batches given
as dicts with labels (the model's own loss). `make_base(dir, seed)` writes such a folder."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import raylane
from raylane.hf.lora import LoraSection, apply_lora
from raylane.loop import checkpoint


class ModelSection(raylane.Section):
    name_or_path: raylane.InputPath
    tokenizer_path: raylane.InputPath | None = None
    seq_len: int = 16


class Config(raylane.BaseConfig):
    model: ModelSection
    lora: LoraSection | None = None


class Tokens(torch.utils.data.Dataset):
    def __init__(self, rows: int, seq_len: int, seed: int) -> None:
        self.ids = torch.randint(0, 128, (rows, seq_len), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def make_base(folder, seed: int = 0, tokenizer: bool = True, tied: bool = False) -> None:
    """A tiny LLaMA with random weights (and a word-level tokenizer of its 128 ids), saved;
    `tied`: its output projection is its input embedding."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>"
        ).save_pretrained(folder)


def build(cfg: Config) -> raylane.Pipeline:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path)
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora)
    return raylane.Pipeline(
        model=model, train_set=Tokens(64, cfg.model.seq_len, 1), eval_set=Tokens(16, cfg.model.seq_len, 2)
    )


def checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model and optimizer tensors and values, flat, read in this process (a
    sharded one through DCP's converter)."""
    path = Path(path)
    if (path / checkpoint.STATE_FILE).exists():
        state = torch.load(path / checkpoint.STATE_FILE, weights_only=True)
        state.pop("rng", None)
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(path), f"{tmp}/state.pt")
            state = torch.load(f"{tmp}/state.pt", weights_only=True)

    def flat(tree, prefix=""):
        items = tree.items() if isinstance(tree, dict) else enumerate(tree)
        out = {}
        for k, v in items:
            if isinstance(v, (dict, list)):
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    return flat({"model": state["model"], "optim": state["optim"]})
