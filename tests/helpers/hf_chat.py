"""A tiny chat model's parts, made here (nothing downloaded): a word-level fast tokenizer over
hf_tiny's words (`w3`..`w63`) plus the role names and the special tokens of two chat template
families, with a real Jinja chat template of either family:

- "chatml" (Qwen2's): `<|im_start|>role\\ncontent<|im_end|>\\n` per message, the generation
  prompt `<|im_start|>assistant\\n`; EOS `<|im_end|>` and pad `<|endoftext|>`, as Qwen2.5-Instruct.
- "inst" (Llama-2's and Mistral's): `<s>[INST] user [/INST] answer </s>`, a system message folded
  into the first user turn, roles that must alternate (else the template raises, as Mistral's);
  BOS `<s>`, EOS `</s>`, no pad token.

Every template uses the same ids, so one tiny Llama (`llama`) serves both. `conversations(n,
seed)` yields random conversations of mixed lengths over the words."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import hf_tiny

ROLES = ("system", "user", "assistant", "tool")
SPECIAL = ("<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>")
# <unk>, <|endoftext|>, <pad>, w3..w63 (hf_tiny's ids), then the roles, then the special tokens.
WORDS = range(3, hf_tiny.VOCAB)
VOCAB = hf_tiny.VOCAB + len(ROLES) + len(SPECIAL)  # 76: the model's vocab covers every token

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
INST = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in turns %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' and loop.first and system %}"
    "{{- '[INST] <<SYS>> ' + system + ' <</SYS>> ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] + ' ' + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
TEMPLATES = {"chatml": CHATML, "inst": INST}
TOKENS = {  # the tokenizer's own special tokens, per template
    "chatml": {"eos_token": "<|im_end|>", "pad_token": hf_tiny.EOS},
    "inst": {"bos_token": "<s>", "eos_token": "</s>"},
}


def chat_tokenizer(template: str | None = "chatml"):
    """A fast tokenizer with `template`'s chat template ("chatml" or "inst"; None: no template,
    ChatML's special tokens still there)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<unk>", hf_tiny.EOS, "<pad>", *(f"w{i}" for i in WORDS), *ROLES, *SPECIAL]
    tok = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # Special tokens are matched before the pre-tokenizer, which would split "<|im_start|>" in three.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (hf_tiny.EOS, "<pad>", *SPECIAL)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **TOKENS[template or "chatml"])
    fast.chat_template = TEMPLATES[template] if template else None
    return fast


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(f"w{rng.choice(WORDS)}" for _ in range(rng.randint(low, high)))


def conversations(
    n: int, seed: int = 0, *, system: float = 0.5, turns: tuple[int, int] = (1, 4)
) -> Iterator[list[dict]]:
    """`n` random conversations: a system message with probability `system`, then `turns` (a
    range) user/assistant pairs, each message 1..24 words (answers 1..40): mixed lengths, from
    a dozen tokens to a few hundred."""
    rng = random.Random(seed)
    for _ in range(n):
        messages = [{"role": "system", "content": words(rng, 1, 12)}] if rng.random() < system else []
        for _ in range(rng.randint(*turns)):
            messages.append({"role": "user", "content": words(rng, 1, 24)})
            messages.append({"role": "assistant", "content": words(rng, 1, 40)})
        yield messages


def llama(folder: str | Path, *, template: str = "chatml", positions: int = 512, seed: int = 0) -> Path:
    """A 2-layer LlamaForCausalLM (hf_tiny.llama's sizes, VOCAB ids) and `template`'s tokenizer,
    saved with save_pretrained in `folder` (the template goes with the tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = chat_tokenizer(template)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=positions,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    folder = Path(folder)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def answer_examples(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """`n` (ids, labels) examples of mixed lengths (3-32 tokens) as raylane.hf.examples encodes a
    prompt and its completion: the labels on the answer, a tail of 1-12 tokens, -100 before it."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, answer = rng.randint(2, 20), rng.randint(1, 12)
        ids = [rng.randrange(3, hf_tiny.VOCAB) for _ in range(prompt + answer)]
        out.append((ids, [-100] * prompt + ids[prompt:]))
    return out
