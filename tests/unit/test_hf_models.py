"""Hugging Face models by what they do, not by their class's name (issue 47): the MLflow flavour and
peft's task type of a GPT-2 (GPT2LMHeadModel, finding 3); one line on the terminal when a model
cannot be logged as one that predicts on text; GPT-2's default LoRA targets are its attention's
projections only, though its MLP reuses the name c_proj (finding 11). Models built on the meta
device from transformers' own config classes (no weights), or saved tiny (tests/helpers/hf_tiny.py)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch

from tests.helpers import hf_tiny


def _meta(auto: str, config):
    import transformers

    with torch.device("meta"):
        return getattr(transformers, auto).from_config(config)


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=hf_tiny.VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)


def test_the_task_is_transformers_registry_of_the_class_not_its_name():
    """GPT2LMHeadModel is a causal LM (its name does not end in ForCausalLM: before, no MLflow
    transformers flavour and no peft task type); a class derived from one is too; a masked LM and
    an encoder-decoder are neither task raylane serves."""
    from transformers import BertConfig, GPT2LMHeadModel, LlamaConfig, T5Config

    from raylane.hf import export, lora

    class Mine(GPT2LMHeadModel):
        pass

    with torch.device("meta"):
        mine = Mine(_gpt2_config())
    tiny = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    cases = {
        "gpt2": (_meta("AutoModelForCausalLM", _gpt2_config()), "text-generation", "CAUSAL_LM"),
        "derived": (mine, "text-generation", "CAUSAL_LM"),
        "llama": (_meta("AutoModelForCausalLM", LlamaConfig(vocab_size=64, **tiny)), "text-generation", "CAUSAL_LM"),
        "gpt2-classifier": (
            _meta("AutoModelForSequenceClassification", _gpt2_config()),
            "text-classification",
            "SEQ_CLS",
        ),
        "bert-mlm": (_meta("AutoModelForMaskedLM", BertConfig(vocab_size=64, **tiny)), None, None),
        "t5": (_meta("AutoModelForSeq2SeqLM", T5Config(vocab_size=64, d_model=16, num_layers=1)), None, None),
    }
    got = {name: (export._task(model), lora._task_type(model)) for name, (model, *_) in cases.items()}
    assert got == {name: (flavour, peft) for name, (_, flavour, peft) in cases.items()}


def test_a_model_that_cannot_predict_on_text_says_so_in_one_line(caplog):
    """What the end of a run logs instead of the transformers flavour (the PyTorch one, token ids
    in) is said on the terminal (a raylane line), once, with why; before, only the library log
    had MLflow's 40-line complaint about the input example."""
    from transformers import BertConfig

    from raylane.hf.export import log_mlflow_model

    tiny = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    bert = _meta("AutoModelForMaskedLM", BertConfig(vocab_size=64, **tiny))
    example = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    caplog.set_level(logging.INFO)
    assert log_mlflow_model(bert, hf_tiny.tokenizer(), example) is None
    gpt2 = _meta("AutoModelForCausalLM", _gpt2_config())
    assert log_mlflow_model(gpt2, None, example) is None
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("raylane")]
    assert lines == [
        "MLflow: the model (BertForMaskedLM) is logged with the PyTorch flavour, which takes token ids, not "
        "text: neither a causal LM nor a sequence classifier",
        "MLflow: the model (GPT2LMHeadModel) is logged with the PyTorch flavour, which takes token ids, not "
        "text: no tokenizer",
    ], lines


def _adapted(model) -> set[str]:
    from peft.tuners.lora import LoraLayer

    return {name.removeprefix("base_model.model.") for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def test_gpt2s_default_lora_targets_are_its_attention_projections_only(tmp_path):
    """GPT-2's MLP reuses c_proj and peft matches by the name's end: the default targets name the
    attention's by a dotted end (attn.c_proj), so the MLP's is not adapted (before: 6 adapted
    modules for 2 layers, not 4). A name given in lora.target_modules keeps its meaning (every
    module of that last name); a dotted end targets one path; a wrong name's hint lists the
    defaults as peft reads them."""
    from raylane.config import ConfigError
    from raylane.hf.lora import LoraSection, apply_lora, check_lora

    folder = hf_tiny.gpt2(tmp_path / "gpt2")
    assert check_lora(str(folder), LoraSection()) == ["c_attn", "attn.c_proj"]
    attention = {f"transformer.h.{i}.attn.{n}" for i in (0, 1) for n in ("c_attn", "c_proj")}
    assert _adapted(apply_lora(_meta("AutoModelForCausalLM", _gpt2_config()), LoraSection(), base="")) == attention

    every = apply_lora(_meta("AutoModelForCausalLM", _gpt2_config()), LoraSection(target_modules=["c_proj"]), base="")
    assert _adapted(every) == {f"transformer.h.{i}.{p}.c_proj" for i in (0, 1) for p in ("attn", "mlp")}
    mlp = apply_lora(_meta("AutoModelForCausalLM", _gpt2_config()), LoraSection(target_modules=["mlp.c_proj"]), base="")
    assert _adapted(mlp) == {f"transformer.h.{i}.mlp.c_proj" for i in (0, 1)}
    with pytest.raises(
        ConfigError,
        match=r"^lora.target_modules = \['nope'\]: GPT2LMHeadModel has no module named 'nope' "
        r"\(its attention projections: attn.c_proj, c_attn\)$",
    ):
        check_lora(str(folder), LoraSection(target_modules=["nope"]))
