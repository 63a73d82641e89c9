"""Writes the config.json (no weights) of Llama-2-7B and of Mixtral-8x7B, as their model cards on
the Hugging Face hub give them, into llama-2-7b/ and mixtral-8x7b/ beside this file (or under OUT),
each with a stand-in tokenizer (a few words: the rehearsal reads the token rows' shapes, not their
ids; a real model's own tokenizer files do as well), and sample.txt, 20,000 of its words: the
`data.train` of hf.yaml, for the shipped hf pipeline's rehearsal."""

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
        _tokenizer().save_pretrained(folder)
        written[name] = folder
    words = [f"w{i % 60}" for i in range(20_000)]
    (out / "sample.txt").write_text("\n".join(" ".join(words[i : i + 100]) for i in range(0, len(words), 100)) + "\n")
    return written


def _tokenizer():
    """A word-level tokenizer of 64 ids: w0..w59, with an EOS token (hf ends each document with it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(60)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>", bos_token="</s>")


if __name__ == "__main__":
    for name, folder in write(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent)).items():
        print(f"{name}: {folder / 'config.json'}")
