"""Tiny Hugging Face models saved with `save_pretrained`, made from transformers' own config classes
(random weights, nothing downloaded), each with a word-level tokenizer over its 64 ids (`w3`..
`w63`): a GPT-2 (Conv1D layers, `c_proj` in its attention and its MLP; its tokenizer has an EOS
token and no pad token, as the real GPT-2's), a LLaMA, and either as a classifier. `rows(folder)`
writes JSON Lines data for them."""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB = 64
EOS = "<|endoftext|>"


def tokenizer(*, eos: bool = True, pad: bool = False, retrained: int | None = None):
    """A fast tokenizer: id 0 unknown, 1 the EOS token (`eos`), 2 a pad token (`pad`);
    `retrained`: the words' ids shuffled with that seed (a tokenizer retrained on other text:
    the same size, every word another id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = list(range(3, VOCAB))
    if retrained is not None:
        random.Random(retrained).shuffle(ids)
    vocab = {"<unk>": 0, EOS: 1, "<pad>": 2, **{f"w{i}": n for i, n in zip(range(3, VOCAB), ids, strict=True)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"eos_token": EOS, "bos_token": EOS} if eos else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", **special, **({"pad_token": "<pad>"} if pad else {})
    )


def save(model, folder: str | Path, *, eos: bool = True, pad: bool = False) -> Path:
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer(eos=eos, pad=pad).save_pretrained(folder)
    return folder


def gpt2(
    folder: str | Path,
    *,
    positions: int = 128,
    labels: int | None = None,
    seed: int = 0,
    eos: bool = True,
    pad: bool = False,
) -> Path:
    """A 2-layer GPT-2 of `positions` positions; `labels`: a GPT2ForSequenceClassification with a
    head of that many labels."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GPT2Config

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=positions, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1
    )
    if labels is not None:
        config.num_labels, config.pad_token_id = labels, 1
    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if labels is None else AutoModelForSequenceClassification
    return save(auto.from_config(config), folder, eos=eos, pad=pad)


def llama(folder: str | Path, *, positions: int = 128, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=positions,
        bos_token_id=1,
        eos_token_id=1,
    )
    torch.manual_seed(seed)
    return save(AutoModelForCausalLM.from_config(config), folder)


def rows(folder: str | Path, n: int = 64, seed: int = 0) -> Path:
    """`train.jsonl` and `eval.jsonl` of {"text", "label"} rows: label 1 when the text's first
    word is below w30."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for name, count in (("train", n), ("eval", n // 4)):
        lines = []
        for _ in range(count):
            words = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 12))]
            lines.append(json.dumps({"text": " ".join(f"w{w}" for w in words), "label": int(words[0] < 30)}))
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def checkpoint(config: dict, run_folder: str | Path, step: int = 1) -> str:
    """A checkpoint in `run_folder` of the model `config`'s pipeline builds, its pretrained
    weights loaded, as a run's save writes it (one process): what a relaunch resumes from."""
    import torch

    from raylane.config import validate
    from raylane.loop import checkpoint as ck
    from raylane.loop import usercode
    from raylane.loop.distributed.fsdp import materialize, on_meta

    cfg = validate(config)
    pipe = usercode.build_pipeline(cfg)
    if on_meta(pipe.model):
        materialize(pipe.model, torch.device("cpu"))
        pipe.init_weights(pipe.model)
    path = Path(run_folder) / ck.checkpoint_name(step)
    path.mkdir(parents=True)
    optimizer = torch.optim.SGD([p for p in pipe.model.parameters() if p.requires_grad], lr=0.1)
    ck.save(path, pipe.model, optimizer, {"step": step, "config": cfg.model_dump(mode="json")}, rank=0)
    return str(path)
