"""Run under torchrun (gloo), 2 ranks: for a tiny `family` causal LM (argv[1]: llama or qwen2),
two copies laid out by raylane's `parallelize` under FSDP2 from the same weights, one fed each
rank's share of 24 examples packed (raylane.hf.packing: position ids, no attention mask), the
other the same share one a row, padded with an attention mask; then without the document mask
(an all-ones attention mask beside the position ids). Each rank writes argv[2]/rank<r>.json: its
losses, and the largest difference of its gradient shards (after FSDP's reduce-scatter over both
ranks) between the packed copy and the padded one, and between the unmasked one and the padded."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.distributed as dist

from raylane.hf.packing import pack, prepare_model
from raylane.loop.distributed.parallelize import parallelize
from raylane.pipelines.gpt import Config
from tests.helpers.hf_chat import answer_examples

SEQ = 48


def model(family: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    sizes = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config((LlamaConfig if family == "llama" else Qwen2Config)(**sizes, **heads))
    prepare_model(m)
    m, _ = parallelize(m.float().train(), Config(strategy={"name": "fsdp"}), torch.device("cpu"), 2)
    return m


def run(m, batch: dict[str, np.ndarray]) -> tuple[float, list[torch.Tensor]]:
    loss = m(**{k: torch.as_tensor(v) for k, v in batch.items()}).loss
    loss.backward()
    return loss.item(), [p.grad.to_local().clone() for p in m.parameters()]


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


dist.init_process_group("gloo")
rank, family, out = dist.get_rank(), sys.argv[1], sys.argv[2]
mine = answer_examples(24, seed=3)[rank::2]
packed, padded = pack(mine, SEQ, 0), pack(mine, SEQ, 0, packing=False)
inputs = packed.arrays()
lengths = np.array([[min(len(ids), SEQ)] for ids, _ in mine])
one_a_row = {"input_ids": padded.input_ids, "labels": padded.labels, "attention_mask": np.arange(SEQ) < lengths}
loss, grads = run(model(family), inputs)
ref_loss, ref_grads = run(model(family), one_a_row)
crossed, crossed_grads = run(model(family), {**inputs, "attention_mask": np.ones_like(packed.input_ids)})
result = {
    "rows": [len(packed.input_ids), len(padded.input_ids)],
    "losses": [loss, ref_loss, crossed],
    "grad_gap": gap(grads, ref_grads),
    "unmasked_grad_gap": gap(crossed_grads, ref_grads),
}
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
