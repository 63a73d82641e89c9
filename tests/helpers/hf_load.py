"""Run under torchrun (2 gloo ranks): for each case of the JSON list in argv[1] ({name, path,
strategy: ddp or fsdp, task, num_labels, lora}), the model built on the meta device, parallelized
by raylane, loaded with raylane.hf.load_pretrained; each rank writes to argv[2]/<name>-rank<r>.json
its opens of weight files (transformers' safe_open, counted during the load), whether tied
embeddings are still one tensor, the largest difference of its full state dict and of its logits
from from_pretrained's, a checksum of the classification head and raylane's warnings. A new head
(a classifier on a bare encoder) is started on rank 0 by from_pretrained: the reference takes
raylane's head before the comparison. With `lora`: a LoRA adapter on it first (raylane.hf.lora,
on the meta device, as the hf pipeline does), compared under the base's names, lora_B zero. A
load that raises writes {"error": its type and message} instead (and the next case goes on)."""

from __future__ import annotations

import json
import logging
import sys

import torch
import torch.distributed as dist
import transformers.modeling_utils
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from raylane.hf.files import AUTO_CLASSES
from raylane.hf.weights import empty_model, load_pretrained
from raylane.loop.distributed.fsdp import unwrap
from raylane.loop.distributed.parallelize import parallelize
from raylane.pipelines.gpt import Config

cases, out = json.loads(open(sys.argv[1]).read()), sys.argv[2]


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def counted_load(model, path) -> list[str]:
    reads, real = [], transformers.modeling_utils.safe_open
    transformers.modeling_utils.safe_open = lambda f, *a, **k: reads.append(str(f)) or real(f, *a, **k)
    try:
        load_pretrained(model, path)
    finally:
        transformers.modeling_utils.safe_open = real
    return reads


def run(case: dict) -> dict:
    task, path = case.get("task", "causal-lm"), case["path"]
    config = {"num_labels": case["num_labels"]} if "num_labels" in case else {}
    model = empty_model(path, task, **config)
    if case.get("lora"):
        from raylane.hf.lora import LoraSection, apply_lora

        model = apply_lora(model, LoraSection(r=4), base=path)
    model, _ = parallelize(model, Config(strategy={"name": case["strategy"]}), torch.device("cpu"), 2)
    warnings = Warnings()
    logging.getLogger("raylane").addHandler(warnings)
    try:
        reads = counted_load(model, path)
    except Exception as exc:  # a checkpoint that cannot fill the model: each rank's error
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        logging.getLogger("raylane").removeHandler(warnings)
    inner = unwrap(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    if case.get("lora"):
        assert all((v == 0).all() for k, v in full.items() if ".lora_B." in k)
        full = {
            k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
            for k, v in full.items()
            if ".lora_" not in k
        }
        inner = inner.get_base_model()
    import transformers

    reference = getattr(transformers, AUTO_CLASSES[task]).from_pretrained(path, dtype=torch.float32, **config)
    expected = reference.state_dict()
    head = sorted(k for k in expected if k.startswith("classifier."))
    with torch.no_grad():
        for key in head:  # a new head: from_pretrained's start on rank 0, broadcast
            expected[key].copy_(full[key])
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()  # as from_pretrained's: no dropout (GPT-2's, BERT's)
    with torch.no_grad():
        logits = (model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()
    embeddings = inner.get_input_embeddings().weight
    return {
        "reads": reads,
        "tied": inner.get_output_embeddings() is not None and inner.get_output_embeddings().weight is embeddings,
        "keys": sorted(full) == sorted(expected),
        "weights_diff": max((full[k].float() - v.float()).abs().max().item() for k, v in expected.items()),
        "logits_diff": logits,
        "head": [float(full[k].double().sum()) for k in head],
        "warnings": warnings.lines,
    }


dist.init_process_group("gloo")
rank = dist.get_rank()
for case in cases:
    result = run(case)
    with open(f"{out}/{case['name']}-rank{rank}.json", "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
