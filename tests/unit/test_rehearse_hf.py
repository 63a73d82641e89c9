"""The shipped `hf` pipeline rehearsed at full size from a model folder holding only its config.json
(and a tokenizer): `raylane check hf --world N` builds the model from the config on the meta device
(raylane.config.shapes), where `raylane train` of the same folder is refused before anything
starts, one line naming the key and the missing weights. The data: a small local text file, of
which the rehearsal reads one micro-batch of packed rows to measure activations."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from raylane import cli
from tests.helpers import hf_tiny


def _config_only(folder: Path, config) -> Path:
    """`config` as config.json in `folder`, beside the tests' tiny tokenizer (64 words): no weights."""
    folder.mkdir(parents=True)
    config.to_json_file(str(folder / "config.json"))
    hf_tiny.tokenizer().save_pretrained(folder)
    return folder


def _text(path: Path, tokens: int) -> Path:
    """A text file of `tokens` words of the tiny tokenizer, one line each 100 words (format: text)."""
    words = [f"w{3 + i % 60}" for i in range(tokens)]
    path.write_text("\n".join(" ".join(words[i : i + 100]) for i in range(0, tokens, 100)) + "\n")
    return path


def _argv(command: str, folder: Path, data: Path, *sets: str) -> list[str]:
    argv = [command, "hf", "--set", f"model.name_or_path={folder}", "--set", f"data.train={data}"]
    for s in ("data.format=text", *sets):
        argv += ["--set", s]
    return argv


@pytest.fixture
def tiny_llama(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=hf_tiny.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=1,
    )
    return _config_only(tmp_path / "llama", config), _text(tmp_path / "train.txt", 3000)


def test_the_hf_pipeline_rehearses_a_config_only_folder_at_256_ranks(tiny_llama, capsys, no_work):
    """Refused before ('no weights') for check and train alike; now the rehearsal builds the model
    from config.json and measures one micro-batch of 8 packed rows of 128 tokens."""
    folder, data = tiny_llama
    code = cli.main([*_argv("check", folder, data, "strategy.name=fsdp"), "--world", "256", "--nodes", "32"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "rehearsal of the hf pipeline at 256 ranks on 32 nodes of 8 H100" in out.out, out.out
    assert "model: LlamaForCausalLM, 22,688 parameters" in out.out, out.out
    assert "layout: hsdp (256 data-parallel ranks)" in out.out, out.out
    rank0 = next(line for line in out.out.splitlines() if line.startswith("  rank 0: "))
    assert "activations not measured" not in rank0 and "activations " in rank0, out.out
    assert "batch: 2,048 samples per step" in out.out and "262,144 tokens" in out.out, out.out


def test_training_a_config_only_folder_is_refused_in_one_line(tiny_llama, capsys, no_work):
    folder, data = tiny_llama
    for command in (["train"], ["check"]):  # `raylane check` alone checks for the run
        code = cli.main(_argv(command[0], folder, data))
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.startswith(f"raylane: invalid config: model.name_or_path = {str(folder)!r}: no weights ("), err
        assert "a config.json alone is rehearsed by `raylane check --world N`" in err, err
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_without_data_the_rehearsal_says_what_it_reads(tiny_llama, capsys, no_work):
    folder, _ = tiny_llama
    code = cli.main(["check", "hf", "--set", f"model.name_or_path={folder}", "--world", "256"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("raylane: invalid config: data.train = None: pipeline 'hf' reads files (a rehearsal"), err
    assert "train.batch_size packed rows of model.seq_len tokens" in err, err


@pytest.mark.slow
def test_hugging_face_7b_configs_without_weights_at_256_ranks_through_the_hf_pipeline(tmp_path, capsys, no_work):
    """Llama-2-7B's and Mixtral-8x7B's config.json alone (examples/rehearse/make_configs.py), through
    the shipped hf pipeline: Llama under FSDP (HSDP 32 x 8) measures its activations from the text
    file's first packed row of 4,096 tokens; Mixtral under FSDP on H100s is refused (rank 0 ~92 GiB),
    and so is pp 4 (the shipped pipeline streams its files); on H200s (141 GiB) FSDP fits."""
    import sys

    from tests.conftest import REPO

    sys.path.insert(0, str(REPO / "examples/rehearse"))
    from make_configs import write

    folders = write(tmp_path)
    for folder in folders.values():
        hf_tiny.tokenizer().save_pretrained(folder)
    data = _text(tmp_path / "train.txt", 20_000)
    flags = ["--world", "256", "--nodes", "32", "--gpu", "H100"]
    sets = ["model.seq_len=4096", "train.batch_size=1", "train.precision=bf16", "strategy.name=fsdp"]
    code = cli.main([*_argv("check", folders["llama-2-7b"], data, *sets), *flags])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "model: LlamaForCausalLM, 6.74B parameters (25.1 GiB)" in out.out, out.out
    assert "  rank 0: 50.8 GiB of 80.0 GiB" in out.out and "activations 37.5 GiB" in out.out, out.out
    mixtral = _argv("check", folders["mixtral-8x7b"], data, *sets)
    code = cli.main([*mixtral, *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("raylane: --gpu H100: rank 0 would need ~92.4 GiB of its 80.0 GiB under hsdp")
    # Through the shipped pipeline's file stream, pp is refused as a run would refuse it (its stages
    # must read the same batches); a pipeline of one's own handing raylane.hf.pipeline a Dataset takes it.
    code = cli.main([*mixtral, "--set", "strategy.pp=4", "--set", "train.batch_size=4", *flags])
    err = capsys.readouterr().err
    assert code == 2 and "strategy.pp = 4: the hf pipeline streams its data" in err, err
    code = cli.main([*mixtral, *flags[:-1], "H200"])
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    assert "model: MixtralForCausalLM, 46.70B parameters" in out.out, out.out
    assert "  rank 0: 92.4 GiB of 141 GiB" in out.out, out.out
