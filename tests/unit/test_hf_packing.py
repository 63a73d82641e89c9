"""Packed sequences (raylane.hf.packing): best-fit decreasing, per-document position ids, and the
loss of a packed batch equal to the same examples run one a row, unpacked and padded, forward and
gradients, on a tiny Llama and a tiny Qwen2 (fp32, in one process; the same on 2 ranks:
tests/e2e/test_hf_packed.py). Without the document mask (an all-ones attention mask beside the
position ids) the packed loss differs: the test says by how much."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raylane.hf.data import causal_tensors
from raylane.hf.packing import IGNORE, best_fit_decreasing, documents_in_rows, pack, prepare_model, real_tokens
from tests.helpers.hf_chat import answer_examples

pytest.importorskip("transformers")

SEQ = 48


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 32), max_size=60), st.integers(32, 64))
def test_best_fit_decreasing_puts_every_example_in_one_bin_within_capacity_the_same_every_time(lengths, capacity):
    bins = best_fit_decreasing(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert best_fit_decreasing(lengths, capacity) == bins
    # No two bins could be merged: a bin is opened only for an example no earlier bin had room
    # for, so any two bins' loads sum past capacity (the two lightest included).
    loads = sorted(sum(lengths[i] for i in b) for b in bins)
    assert len(loads) < 2 or loads[0] + loads[1] > capacity, loads


def test_best_fit_takes_the_fullest_bin_that_fits():
    # 30 and 25 open two bins of 48; 18 fits both: the one with less room (30's, 18 left) takes it.
    assert best_fit_decreasing([30, 25, 18, 20], 48) == [[0, 2], [1, 3]]


def test_a_packed_row_restarts_positions_and_never_labels_a_documents_first_token():
    packed = pack([([5, 6, 7], [5, 6, 7]), ([8, 9], [8, 9])], 8, pad_id=0)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert packed.labels.tolist() == [[IGNORE, 6, 7, IGNORE, 9, IGNORE, IGNORE, IGNORE]]
    assert packed.real_tokens == 5 and (packed.labels != IGNORE).sum() == 3
    assert pack([(list(range(3, 13)), list(range(3, 13)))], 8, pad_id=0).input_ids.tolist() == [list(range(3, 11))]


def test_packing_fills_sequences_where_one_a_row_pads_them():
    examples = answer_examples(400, seed=1)
    packed, padded = pack(examples, SEQ, 0), pack(examples, SEQ, 0, packing=False)
    assert packed.real_tokens == padded.real_tokens
    efficiency = packed.real_tokens / packed.input_ids.size
    assert efficiency >= 0.95, efficiency
    assert padded.real_tokens / padded.input_ids.size < 0.5  # the same examples one a row


@pytest.mark.parametrize("pad_id", [0, 2], ids=["a pad token of its own", "pad is an example's token"])
def test_the_loop_counts_a_batchs_real_tokens_as_packing_placed_them(pad_id):
    """What raylane.loop.steps.Throughput reads from each micro-batch on the host (the padding
    share, real tokens/s): exactly the packer's own count, packed and one a row, whether or not
    the pad id is also a token of the examples (an end-of-turn token, say)."""
    examples = answer_examples(120, seed=3)
    examples += [([4, 2, 2], [IGNORE, 2, 2])]  # ends in the pad id, with labels: data, not padding
    for packing in (True, False):
        rows = pack(examples, SEQ, pad_id, packing=packing)
        batch = causal_tensors(rows.arrays())
        assert int(real_tokens(batch, pad_id)) == rows.real_tokens
    full = pack([([5] * 8, [5] * 8)], 8, pad_id)  # a row with no padding at all
    assert int(real_tokens(causal_tensors(full.arrays()), pad_id)) == 8
    assert real_tokens({"input_ids": torch.ones(2, 8, dtype=torch.long)}, pad_id) is None  # joined text


def test_plain_text_with_the_document_mask_restarts_positions_where_a_document_or_a_row_starts():
    out = documents_in_rows([[3, 4, 5], [6, 7], [8, 9, 10, 11]], 4)
    assert out["input_ids"].tolist() == [[3, 4, 5, 6], [7, 8, 9, 10]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0], [0, 0, 1, 2]]
    assert out["labels"].tolist() == [[IGNORE, 4, 5, IGNORE], [IGNORE, IGNORE, 9, 10]]


def _model(family: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    config = (LlamaConfig if family == "llama" else Qwen2Config)(**sizes, **heads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    prepare_model(model)  # as raylane.hf.build does for packed data: no cache, so the mask comes from positions
    return model.train()


def _loss_and_grads(model, batch: dict[str, np.ndarray]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**{k: torch.as_tensor(v) for k, v in batch.items()}).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_packed_batch_has_the_loss_and_gradients_of_its_examples_one_a_row(family):
    """12 examples of 3-32 tokens, the loss on their answers: packed into 6 rows of 48 (their
    documents masked from each other by position ids), or one a row, right-padded with an
    attention mask. Loss and every gradient within 1e-5 (fp32). With an all-ones attention mask
    beside the position ids, which turns transformers' document mask off, the packed loss is off."""
    model, examples = _model(family), answer_examples(12, seed=2)
    packed = pack(examples, SEQ, 0)
    assert len(packed.input_ids) < len(examples) // 1.5  # several documents a row
    padded = pack(examples, SEQ, 0, packing=False)
    one_a_row = {
        "input_ids": padded.input_ids,
        "labels": padded.labels,
        "attention_mask": (padded.position_ids == np.arange(SEQ))
        & (np.arange(SEQ) < np.array([[len(i)] for i, _ in examples])),
    }
    inputs = packed.arrays()
    loss, grads = _loss_and_grads(model, inputs)
    ref_loss, ref_grads = _loss_and_grads(model, one_a_row)
    assert abs(loss - ref_loss) <= 1e-5, (loss, ref_loss)
    worst = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    assert worst <= 1e-5, worst

    unmasked = {**inputs, "attention_mask": np.ones_like(packed.input_ids)}
    crossed, _ = _loss_and_grads(model, unmasked)
    assert abs(crossed - ref_loss) > 1e-4, (crossed, ref_loss)  # measured: 1.3e-3 on the Llama
