"""A tiny chat model and chat data, made here (nothing downloaded): a LLaMA-architecture model with
random weights, a BPE tokenizer trained on Python's own help texts (pydoc_data) with a ChatML chat
template (`<|im_start|>role\\n...<|im_end|>`, as Qwen2's), and conversations about those help texts.
Writes, under OUT:

- model/                  save_pretrained of the model and its tokenizer (chat template included)
- train.jsonl, eval.jsonl   one conversation a line: {"messages": [{"role": ..., "content": ...}, ...]}
                          a system message, then one to three questions on a help topic, each answered
                          with a paragraph of it (answers of a few words to a few hundred tokens)
- pairs.jsonl             the same as {"prompt": ..., "completion": ...} (data.style: prompt_completion)

    python make_chat.py chat
    raylane train sft.yaml --local      # sft.yaml reads chat/; without --local, on Ray"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def topics() -> dict[str, list[str]]:
    """Python's help topics and their paragraphs, in a fixed order."""
    import pydoc_data.topics

    out = {}
    for name in sorted(pydoc_data.topics.topics):
        paragraphs = [" ".join(p.split()) for p in pydoc_data.topics.topics[name].split("\n\n")]
        if kept := [p for p in paragraphs if 40 < len(p) < 1200]:
            out[name] = kept
    return out


def tokenizer(texts: list[str], vocab_size: int = 768):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=alphabet)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    return fast


def conversation(rng: random.Random, name: str, paragraphs: list[str]) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You answer questions about Python."}]
    for paragraph in rng.sample(paragraphs, min(len(paragraphs), rng.randint(1, 3))):
        messages.append({"role": "user", "content": f"What does the help on {name} say?"})
        messages.append({"role": "assistant", "content": paragraph})
    return messages


def make(out: str | Path, *, seed: int = 0, eval_share: float = 0.1) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    out, rng = Path(out), random.Random(seed)
    found = topics()
    tok = tokenizer([p for ps in found.values() for p in ps])
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out / "model")
    tok.save_pretrained(out / "model")
    chats = [conversation(rng, name, ps) for name, ps in found.items()]
    cut = int(len(chats) * (1 - eval_share))
    for file, rows in (("train.jsonl", chats[:cut]), ("eval.jsonl", chats[cut:])):
        (out / file).write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    pairs = [{"prompt": m[1]["content"], "completion": m[2]["content"]} for m in chats]
    (out / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    print(f"wrote {make(parser.parse_args().out)}")
