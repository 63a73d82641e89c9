"""Run under torchrun (2 gloo ranks): the model of argv[1] built on the meta device, parallelized
by raylane (argv[2]: ddp or fsdp), loaded with raylane.hf.load_pretrained; each rank writes to
argv[3]/rank<r>.json its reads of weight files, whether the embeddings are still tied, the
largest difference of its full state dict from the saved weights, and of its logits from
from_pretrained's. argv[4] == "lora": a LoRA adapter on it first (raylane.hf.apply_lora, on the
meta device, as the hf pipeline does): the base's tensors under peft's names, the adapter's
lora_B zeros, so the logits are still the base's."""

from __future__ import annotations

import json
import sys

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from raylane.hf.weights import empty_model, load_pretrained
from raylane.loop.parallel import parallelize, unwrap
from raylane.pipelines.gpt import Config

path, strategy, out = sys.argv[1:4]
lora = sys.argv[4:5] == ["lora"]
reads = []
real = safetensors.torch.load_file
safetensors.torch.load_file = lambda f, *a, **k: reads.append(f) or real(f, *a, **k)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = empty_model(path)
if lora:
    from raylane.hf.lora import LoraSection, apply_lora

    model = apply_lora(model, LoraSection(r=4), base=path)
model, _ = parallelize(model, Config(strategy={"name": strategy}), torch.device("cpu"), 2)
load_pretrained(model, path)
inner = unwrap(model)
inner = inner.get_base_model() if lora else inner
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
saved = real(f"{path}/model.safetensors")
if lora:
    assert all((v == 0).all() for k, v in full.items() if ".lora_B." in k)
    full = {
        k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
        for k, v in full.items()
        if ".lora_" not in k
    }
weights = max((full[k].float() - v.float()).abs().max().item() for k, v in saved.items())
safetensors.torch.load_file = real
from transformers import AutoModelForCausalLM  # noqa: E402 - after the count above, which patches safetensors

reference = AutoModelForCausalLM.from_pretrained(path)
ids = torch.randint(0, reference.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    logits = (model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(
        {
            "reads": reads,
            "tied": inner.lm_head.weight is inner.model.embed_tokens.weight,
            "weights_diff": weights,
            "logits_diff": logits,
            "keys": sorted(full)
            == sorted(k.replace(".base_layer.", ".") for k in inner.state_dict() if ".lora_" not in k),
        },
        f,
    )
dist.destroy_process_group()
