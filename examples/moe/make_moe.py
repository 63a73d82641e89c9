"""A tiny mixture of experts and text to train it on, made here (nothing downloaded): a Qwen2-MoE
(transformers' own class, random weights) whose experts hold most of its parameters, and a BPE
tokenizer trained on Python's own help texts (pydoc_data, installed with Python). Writes, under OUT:

- model/   save_pretrained of the model and its tokenizer (what `model.name_or_path` names):
           2 decoder layers, each 8 experts (top-2 of a softmax router) beside a small shared
           expert; the experts are 82% of the parameters
- train/   JSON Lines, one {"text": ...} a line, in 4 files (each rank reads whole files under
           torchrun: at least one file per rank)

    python make_moe.py moe
    torchrun --standalone --nproc_per_node 2 -m raylane train ep.yaml    # ep.yaml reads moe/

The benchmark B17 (scripts/benchmarks/moe.py) imports `make(out)`; it takes a few seconds."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
FILES = 4


def corpus() -> list[str]:
    """Paragraphs of Python's help texts, in a fixed order."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    paragraphs = [" ".join(p.split()) for k in sorted(topics) for p in topics[k].split("\n\n")]
    return [p for p in paragraphs if len(p) > 40]


def tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def config(vocab: int, tok, *, experts: int = 8, hidden: int = 64, layers: int = 2):
    """Qwen2-MoE's own config: every layer a sparse one (decoder_sparse_step 1), each expert a
    SwiGLU of moe_intermediate_size, the shared expert a quarter of one layer's experts."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=2 * hidden,
        shared_expert_intermediate_size=hidden,
        intermediate_size=2 * hidden,  # the dense MLP's, for layers that are not sparse: none here
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def make(
    out: str | Path, *, experts: int = 8, hidden: int = 64, layers: int = 2, vocab_size: int = 512, seed: int = 0
) -> Path:
    """Writes OUT/model (model and tokenizer) and OUT/train/; returns OUT."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    texts = corpus()
    tok = tokenizer(texts, vocab_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(len(tok), tok, experts=experts, hidden=hidden, layers=layers))
    model.save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    rows = list(texts)
    random.Random(seed).shuffle(rows)
    (out / "train").mkdir(parents=True, exist_ok=True)
    for i in range(FILES):
        with open(out / "train" / f"part-{i}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in rows[i::FILES])
    return out


def parameter_bytes(model) -> dict[str, int]:
    """{'experts': ..., 'rest': ...}: the bytes of the experts modules' parameters (the ones
    strategy.ep splits) and of every other parameter."""
    sizes = {"experts": 0, "rest": 0}
    for name, p in model.named_parameters():
        sizes["experts" if ".experts." in name else "rest"] += p.numel() * p.element_size()
    return sizes


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output folder")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size; each expert's is twice it")
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    where = make(args.out, experts=args.experts, hidden=args.hidden, layers=args.layers)
    print(f"model and tokenizer in {where / 'model'}; data in {where / 'train'}")
