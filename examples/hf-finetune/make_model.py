"""A small LLaMA-architecture model with random weights and a BPE tokenizer trained on Python's own
help texts (pydoc_data, installed with Python): nothing is downloaded. Writes, under OUT:

- model/       save_pretrained of the model and its tokenizer (what `model.name_or_path` names)
- train/, eval/  JSON Lines files (4 and 2: each rank reads whole files under torchrun), one
                {"text": ..., "label": 0 or 1} per line: paragraphs of the help texts, labelled 1
                when they hold an indented block (code, a grammar, a table)

    python make_model.py OUT [--layers 2] [--hidden 64]

Tests import `make(out)`; it takes a few seconds."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def corpus() -> list[str]:
    """Paragraphs of Python's help texts, in a fixed order."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    paragraphs = [p.strip() for k in sorted(topics) for p in topics[k].split("\n\n")]
    return [p for p in paragraphs if len(p) > 40]


def make_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def make(out: str | Path, *, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
         vocab_size: int = 512, seq_len: int = 256, tie: bool = True, seed: int = 0) -> Path:
    """Writes OUT/model (model and tokenizer), OUT/train/ and OUT/eval/; returns OUT."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    out = Path(out)
    texts = corpus()
    tokenizer = make_tokenizer(texts, vocab_size)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=seq_len, tie_word_embeddings=tie,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    rows = [{"text": t, "label": int("   " in t)} for t in texts]
    random.Random(seed).shuffle(rows)
    held = len(rows) // 10
    for name, part, files in (("eval", rows[:held], 2), ("train", rows[held:], 4)):
        (out / name).mkdir(parents=True, exist_ok=True)
        for i in range(files):
            with open(out / name / f"part-{i}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in part[i::files])
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()
    where = make(args.out, layers=args.layers, hidden=args.hidden)
    print(f"model and tokenizer in {where / 'model'}; data in {where / 'train'}, {where / 'eval'}")
