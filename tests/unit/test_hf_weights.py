"""Pretrained weights loaded as transformers loads them (raylane.hf.weights), in one process: a
mixture of experts saved expert by expert (transformers 5's layout, Mixtral's under its legacy
names) gives every expert and router of from_pretrained; a tensor of the base model the files
lack is an error naming it, before the run and at load; a new head is started by from_pretrained
and listed in one line. On 2 ranks under DDP and FSDP: tests/e2e/test_hf.py."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from raylane.hf.weights import empty_model, load_pretrained  # noqa: E402
from raylane.loop.distributed.fsdp import materialize  # noqa: E402
from tests.helpers import hf_families  # noqa: E402


def _loaded(path, task: str = "causal-lm", **config):
    """The model raylane builds (meta device, then storage) and fills from `path`."""
    model = materialize(empty_model(path, task, **config), torch.device("cpu"))
    load_pretrained(model, path)
    return model


def _keys(path) -> list[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def _without(path, *names: str) -> None:
    """The folder's weights file rewritten without `names`."""
    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k not in names}, path / "model.safetensors", {"format": "pt"})


@pytest.mark.parametrize(
    ("family", "saved", "fused"),
    [
        ("qwen2_moe", "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"),
        ("mixtral", "model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.layers.0.mlp.experts.gate_up_proj"),
    ],
)
def test_a_moe_checkpoint_saved_expert_by_expert_loads_every_expert_as_from_pretrained(tmp_path, family, saved, fused):
    """transformers 5 saves the experts one by one (Mixtral's under its legacy names, its router
    as block_sparse_moe.gate) and fuses them on load: every tensor, experts and routers included,
    equals from_pretrained's, and so do the logits. Before, the 1:1 name map found no fused
    tensor and started the experts (and Mixtral's router) at random."""
    from transformers import AutoModelForCausalLM

    path = hf_families.save(tmp_path / family, family)
    assert saved in _keys(path) and fused not in _keys(path)
    model = _loaded(path)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert sorted(ours) == sorted(theirs)
    moe = [k for k in theirs if ".experts." in k or ".mlp.gate." in k]
    assert fused in moe and "model.layers.1.mlp.gate.weight" in moe
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
    ids = hf_families.ids()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_tensor_of_the_base_model_missing_from_the_files_is_an_error_naming_it(tmp_path):
    """Not a silent random start: load_pretrained raises one line naming the tensor and
    model.name_or_path (every rank raises it: tests/e2e), and check_weights, the check before
    the run (exit 2: tests/e2e/test_hf.py), says the same from the files' headers alone."""
    path = hf_families.save(tmp_path / "llama", "llama")
    _without(path, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ValueError) as raised:  # WeightsError, a DataError: every launcher shows it as it is
        _loaded(path)
    from raylane.hf.weights import WeightsError, check_weights

    assert isinstance(raised.value, WeightsError)
    text = str(raised.value)
    assert text.startswith(f"model.name_or_path = {str(path)!r}: the weights lack model.layers.1.mlp.down_proj.weight")
    assert "\n" not in text
    with pytest.raises(ValueError) as checked:
        check_weights(path)
    assert str(checked.value) == text


def test_an_expert_missing_from_the_files_names_the_fused_tensor_transformers_cannot_build(tmp_path):
    """One expert's up projection gone: transformers cannot fuse layer 1's gate_up_proj; the
    check before the run names that tensor (the conversion's error goes to the library log)."""
    from raylane.hf.weights import check_weights

    path = hf_families.save(tmp_path / "moe", "qwen2_moe")
    _without(path, "model.layers.1.mlp.experts.2.up_proj.weight")
    with pytest.raises(ValueError) as checked:
        check_weights(path)
    assert "transformers cannot build model.layers.1.mlp.experts.gate_up_proj of Qwen2MoeForCausalLM" in str(
        checked.value
    )


def test_a_new_classification_head_is_started_by_from_pretrained_and_listed_in_one_line(tmp_path, caplog):
    """A BERT encoder (no head saved) as a 3-class classifier: every tensor of the base equals
    from_pretrained's, the head is transformers' own start (zero bias), named in one warning (a
    worker's warnings reach the driver's terminal)."""
    from transformers import AutoModelForSequenceClassification

    path = hf_families.save(tmp_path / "bert", "bert")
    with caplog.at_level(logging.INFO, logger="raylane"):
        model = _loaded(path, "sequence-classification", num_labels=3)
    lines = [r for r in caplog.records if r.name == "raylane"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "classifier.bias, classifier.weight not in the weights: initialized as from_pretrained does" in (
        lines[0].getMessage()
    )
    reference = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3, dtype=torch.float32)
    ours = model.state_dict()
    for key, value in reference.state_dict().items():
        if not key.startswith("classifier."):
            assert torch.equal(ours[key], value), key
    assert ours["classifier.weight"].shape == (3, 32) and not ours["classifier.bias"].any()


def test_a_lora_classifiers_head_copy_starts_as_its_original(tmp_path):
    """peft keeps a classifier's head trainable as a copy (modules_to_save) beside the original:
    both start from the one head from_pretrained starts, and the base under peft's names is the
    saved one. Before, each of the two was drawn at random on its own."""
    from transformers import AutoModelForSequenceClassification

    from raylane.hf.lora import LoraSection, apply_lora

    path = hf_families.save(tmp_path / "bert", "bert")
    model = apply_lora(empty_model(path, "sequence-classification", num_labels=3), LoraSection(r=2), base=str(path))
    model = materialize(model, torch.device("cpu"))
    load_pretrained(model, path)
    state = model.state_dict()
    head = "base_model.model.classifier."
    assert torch.equal(state[head + "original_module.weight"], state[head + "modules_to_save.default.weight"])
    reference = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3, dtype=torch.float32)
    merged = model.merge_and_unload().state_dict()  # lora_B is zero: the base, under its own names
    for key, value in reference.state_dict().items():
        if not key.startswith("classifier."):
            assert torch.equal(merged[key], value), key


def test_a_tensor_of_another_shape_in_the_files_is_named_with_both_shapes(tmp_path):
    """A saved 2-class head under a 3-class model: from_pretrained refuses it (no
    ignore_mismatched_sizes), and so does the check, naming each tensor and both shapes."""
    from transformers import AutoModelForSequenceClassification

    from raylane.hf.weights import check_weights

    AutoModelForSequenceClassification.from_config(hf_families.bert(num_labels=2)).save_pretrained(tmp_path / "cls")
    with pytest.raises(ValueError) as checked:
        check_weights(tmp_path / "cls", "sequence-classification", num_labels=3)
    assert str(checked.value).endswith(
        "not a checkpoint of this BertForSequenceClassification: classifier.bias is [2] in the files, [3] in the "
        "model; classifier.weight is [2, 32] in the files, [3, 32] in the model"
    )
