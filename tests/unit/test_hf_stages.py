"""raylane.hf.pipeline_parallel: the pipeline stages of Hugging Face causal LMs, in one process. The split
keeps the model's own names with every parameter on exactly one stage (on the meta device, Llama,
GPT-2 and Mixtral, with and without LoRA); the stages run one after the other give the model's
logits and loss exactly (transformers' forward rebuilds positions, rotary embeddings and the
causal mask from the hidden states a later stage receives); a tied model, a batch with a padding
mask and too many stages are refused in one line."""

from __future__ import annotations

import pytest
import torch

from raylane.hf.pipeline_parallel import causal_lm_stages, check_pp
from raylane.loop.distributed.blocks import find_blocks
from raylane.loop.distributed.pipeline_parallel import stage_module
from raylane.loop.distributed.pipeline_split import split_names
from raylane.loop.protocols.batches import BatchFormError
from tests.helpers import hf_families

pytest.importorskip("transformers")


def _model(family: str, meta: bool = False, **extra):
    from transformers import AutoModelForCausalLM

    config = getattr(hf_families, family)(**extra)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return AutoModelForCausalLM.from_config(config)


def _stages(model, n: int):
    split = causal_lm_stages()
    names, container = split_names(model, find_blocks(model), split.names, n)
    return names, [stage_module(model, names, i, container, split.call) for i in range(n)]


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
@pytest.mark.parametrize("lora", [False, True])
def test_the_split_keeps_names_and_puts_every_parameter_on_one_stage(family, lora):
    model = _model(family, meta=True, tie_word_embeddings=False)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"] if family == "gpt2" else ["q_proj"]))
    names = check_pp(model, 2)
    _, stages = _stages(model, 2)
    held = [{n for n, _ in stage.named_parameters()} for stage in stages]
    assert not held[0] & held[1]
    assert held[0] | held[1] == {n for n, _ in model.named_parameters()}
    first, last = (name.removeprefix("base_model.model.") for name in (names[0][0], names[-1][-1]))
    assert first in ("model.embed_tokens", "transformer.wte") and last == "lm_head"
    assert any(".0." in n or n.endswith(".0") for n in names[0]) and not any(".0." in n for n in names[1])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_stages_run_in_turn_give_the_model_s_logits_and_loss(family):
    model = _model(family, tie_word_embeddings=False, num_hidden_layers=3)
    model.eval()
    ids = hf_families.ids(batch=2, length=16)
    _, (s0, s1) = _stages(model, 2)
    split = causal_lm_stages()
    with torch.no_grad():
        hidden = s0(ids)
        logits = s1(hidden)
        reference = model(input_ids=ids, labels=ids)
    assert hidden.shape == (2, 16, model.config.hidden_size)
    assert torch.equal(logits, reference.logits)
    assert torch.equal(split.loss_fn(logits, ids), reference.loss)
    assert split.pair({"input_ids": ids, "labels": ids})[0] is ids


def test_a_tied_model_a_padded_batch_and_too_many_stages_are_one_line():
    with pytest.raises(ValueError) as tied:
        check_pp(_model("llama", meta=True, tie_word_embeddings=True), 2)
    assert str(tied.value) == (
        "LlamaForCausalLM ties its input embedding and lm_head (config.tie_word_embeddings = true): one parameter "
        "on the first and the last stage, which would train apart; pipeline parallelism needs a model saved with "
        "tie_word_embeddings=false"
    )
    with pytest.raises(
        ValueError, match=r"^Pipeline.pp_stages = 'auto': 4 stages for the 2 blocks of LlamaForCausalLM$"
    ):
        check_pp(_model("llama", meta=True, tie_word_embeddings=False), 4)
    ids = torch.zeros((2, 4), dtype=torch.long)
    with pytest.raises(BatchFormError, match="no attention_mask") as padded:
        causal_lm_stages().pair({"input_ids": ids, "attention_mask": ids, "labels": ids})
    assert len(str(padded.value).splitlines()) == 1
