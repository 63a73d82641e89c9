"""Run under torchrun (gloo): for each case of the JSON list in argv[1] ({name, path, tp, lora}),
a transformers model (or a LoRA adapter on one) built on the meta device, laid out by raylane's
`parallelize` with the model's own plan (raylane.hf.tensor_parallel.tp_plan: transformers' tp_plan as
torch's styles, on raylane's (dp_shard, tp) mesh), loaded by raylane.hf.load_pretrained (rank 0
reads, the rest receive), then trained 3 SGD steps (raylane's optimizer and clipping) beside a
one-process copy started from the same full state, each on the whole batch (the parallel run's
data-parallel ranks each on their share). Each rank writes argv[2]/<name>-rank<r>.json: its
opens of weight files, whether the head is still the embedding, its logits' largest difference
from `from_pretrained`'s (fp32), each step's loss beside the one process's, and the trained
weights' largest difference from the one process's. A case with a "checkpoint" ({path, config})
saves raylane's checkpoint of the trained model there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from raylane.hf.lora import LoraSection, apply_lora
from raylane.hf.tensor_parallel import tp_plan
from raylane.hf.weights import empty_model, load_pretrained
from raylane.loop import checkpoint
from raylane.loop.distributed.parallelize import parallelize
from raylane.loop.optim import build_optimizer
from raylane.loop.steps import clip_gradients
from raylane.pipelines.gpt import Config

cases, out = json.loads(open(sys.argv[1]).read()), sys.argv[2]
BATCH, LENGTH, STEPS = 4, 16, 3


def counted_load(model, path) -> list[str]:
    reads, real = [], transformers.modeling_utils.safe_open
    transformers.modeling_utils.safe_open = lambda f, *a, **k: reads.append(str(f)) or real(f, *a, **k)
    try:
        load_pretrained(model, path)
    finally:
        transformers.modeling_utils.safe_open = real
    return reads


def full_state(model) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def batch(step: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (BATCH, LENGTH), generator=torch.Generator().manual_seed(step))


def step(model, optimizer, ids: torch.Tensor, plain: bool) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    clip_gradients([p for g in optimizer.param_groups for p in g["params"]], 1.0, plain=plain)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def save(where: dict, model, optimizer) -> None:
    """raylane's checkpoint of the trained model (every rank its shards) at where["path"], its
    manifest's config where["config"] (the run's, as `raylane export` rebuilds the pipeline)."""
    path = Path(where["path"]) / checkpoint.checkpoint_name(STEPS)
    checkpoint.save(path, model, optimizer, {"step": STEPS, "config": where["config"]}, rank=dist.get_rank())


def run(case: dict) -> dict:
    path, tp, world, rank = case["path"], case["tp"], dist.get_world_size(), dist.get_rank()
    lora = LoraSection(r=4) if case.get("lora") else None
    cfg = Config(strategy={"name": "fsdp", "tp": tp}, optim={"name": "sgd", "lr": 0.5, "weight_decay": 0.0})
    model = empty_model(path)
    if lora:
        model = apply_lora(model, lora, base=path)
    model, strategy = parallelize(model, cfg, torch.device("cpu"), world, tp_plan=tp_plan)
    reads = counted_load(model, path)
    optimizer = build_optimizer(model, cfg)  # before any forward (trap c)
    start = full_state(model)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        reference = apply_lora(reference, lora, base=path)
    reference.load_state_dict(start)  # the adapter as rank 0 started it; the base as from_pretrained's
    vocab = reference.config.vocab_size
    ids = batch(0, vocab)
    with torch.no_grad():
        logits = (model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()
    inner = model.get_base_model() if lora else model
    tied = inner.get_output_embeddings().weight is inner.get_input_embeddings().weight
    one = build_optimizer(reference, cfg)
    share = BATCH // (world // tp)
    mine = slice(rank // tp * share, (rank // tp + 1) * share)
    losses = []
    for s in range(STEPS):
        ids = batch(s + 1, vocab)
        ours = torch.tensor(step(model, optimizer, ids[mine], plain=False) / world)  # tp peers: the same loss
        dist.all_reduce(ours)
        losses.append([ours.item(), step(reference, one, ids, plain=True)])
    if "checkpoint" in case:
        save(case["checkpoint"], model, optimizer)
    trained, expected = full_state(model), reference.state_dict()
    moved = {k for k in expected if not torch.equal(start[k], expected[k])}
    return {
        "strategy": strategy.label,
        "reads": reads,
        "tied": tied,
        "logits_diff": logits,
        "losses": losses,
        "weights_diff": max((trained[k] - v).abs().max().item() for k, v in expected.items()),
        "trained": sorted(moved),
        "frozen_trained": sorted(k for k in moved if ".lora_" not in k) if lora else [],
    }


dist.init_process_group("gloo")
rank = dist.get_rank()
for case in cases:
    result = run(case)
    with open(f"{out}/{case['name']}-rank{rank}.json", "w") as f:
        json.dump(result, f)
dist.destroy_process_group()
