"""What a Hugging Face model's own config and tokenizer already tell, checked before anything
starts (issue 47, finding 5): `model.seq_len` against the model's positions, `model.num_labels`
against a saved classification head, the tokenizer's EOS/pad token for the task. Each is one line
naming the key, its value and the model's figure, exit 2, from `raylane check` (the same
validation `raylane train` runs before Ray or a worker starts). Tiny models made here
(tests/helpers/hf_tiny.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from raylane import cli
from tests.helpers import hf_tiny


def _check(capsys, folder, data, *sets: str) -> tuple[int, str]:
    argv = ["check", "hf", "--set", f"model.name_or_path={folder}", "--set", f"data.train={data / 'train.jsonl'}"]
    for s in sets:
        argv += ["--set", s]
    capsys.readouterr()  # what making the models printed (transformers' progress bars)
    code = cli.main(argv)
    return code, capsys.readouterr().err


def _refused(capsys, folder, data, *sets: str) -> str:
    code, err = _check(capsys, folder, data, *sets)
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.fixture
def data(tmp_path):
    return hf_tiny.rows(tmp_path / "data", n=8)


def test_seq_len_beyond_the_models_positions_is_refused_naming_both(tmp_path, data, capsys, no_work):
    """The newcomer's GPT-2 (n_positions 128, seq_len 256) failed a minute into the run with
    IndexError; a LLaMA's limit is max_position_embeddings. At the limit, both pass."""
    gpt2 = hf_tiny.gpt2(tmp_path / "gpt2", positions=32)
    line = _refused(capsys, gpt2, data, "model.seq_len=64")
    assert line == (
        f"raylane: invalid config: model.seq_len = 64: more than the model's 32 positions (n_positions in "
        f"{gpt2 / 'config.json'}); set model.seq_len=32 or lower"
    ), line
    llama = hf_tiny.llama(tmp_path / "llama", positions=16)
    line = _refused(capsys, llama, data, "model.seq_len=17")
    assert "model.seq_len = 17: more than the model's 16 positions (max_position_embeddings in" in line, line
    assert _check(capsys, gpt2, data, "model.seq_len=32")[0] == 0
    assert _check(capsys, llama, data, "model.seq_len=16")[0] == 0


def test_a_model_that_declares_no_positions_takes_any_seq_len(tmp_path, data, capsys, no_work):
    """A state-space model (Mamba) has no position table and no maximum: nothing to refuse."""
    import torch
    from transformers import AutoModelForCausalLM, MambaConfig

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=hf_tiny.VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1)
    mamba = hf_tiny.save(AutoModelForCausalLM.from_config(config), tmp_path / "mamba")
    assert _check(capsys, mamba, data, "model.seq_len=100000")[0] == 0


def test_num_labels_other_than_the_saved_head_is_refused(tmp_path, data, capsys, no_work):
    """A classifier saved with a 3-label head: model.num_labels=2 failed when the weights loaded
    (size mismatch for score.weight); 3 passes, and a causal LM's folder (no head) takes any."""
    cls = hf_tiny.gpt2(tmp_path / "cls", labels=3)
    line = _refused(capsys, cls, data, "model.task=sequence-classification", "model.num_labels=2")
    assert line.endswith(
        f"model.num_labels = 2: the model in '{cls}' has a classification head of 3 labels (a "
        "GPT2ForSequenceClassification, says its config.json); set model.num_labels=3"
    ), line
    assert _check(capsys, cls, data, "model.task=sequence-classification", "model.num_labels=3")[0] == 0
    lm = hf_tiny.gpt2(tmp_path / "lm")
    assert _check(capsys, lm, data, "model.task=sequence-classification", "model.num_labels=5")[0] == 0


def test_the_tokenizer_has_the_special_tokens_its_task_uses(tmp_path, data, capsys, no_work):
    """causal-lm ends each packed document with EOS: a tokenizer without one is refused (documents
    ran into each other unmarked). A classifier pads with the pad token, else EOS (GPT-2 has
    only EOS: it passes); with neither, it is refused (it padded with id 0, a real token)."""
    no_eos = hf_tiny.gpt2(tmp_path / "no-eos", eos=False)
    line = _refused(capsys, no_eos, data)
    assert line.endswith(
        f"model.name_or_path = '{no_eos}': the tokenizer has no EOS token, which model.task = 'causal-lm' "
        "ends each document with; set one (tokenizer.eos_token = ...) and save_pretrained it"
    ), line
    line = _refused(capsys, no_eos, data, "model.task=sequence-classification")
    assert f"model.name_or_path = '{no_eos}': the tokenizer has neither a pad nor an EOS token" in line, line
    # The tokenizer named by model.tokenizer_path is the one checked, under its key.
    tok = hf_tiny.gpt2(tmp_path / "tok", pad=True, eos=False)
    code, err = _check(capsys, no_eos, data, "model.task=sequence-classification", f"model.tokenizer_path={tok}")
    assert code == 0, err
    line = _refused(capsys, no_eos, data, f"model.tokenizer_path={tok}")
    assert f"model.tokenizer_path = '{tok}': the tokenizer has no EOS token" in line, line
    gpt2 = hf_tiny.gpt2(tmp_path / "gpt2")
    assert _check(capsys, gpt2, data, "model.task=sequence-classification")[0] == 0
