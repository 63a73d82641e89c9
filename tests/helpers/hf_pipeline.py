"""Run under torchrun (gloo) by tests/e2e/test_hf_pipeline.py: a tiny untied Llama saved in argv[1],
in full and with a LoRA adapter, built on the meta device and split into pipeline stages by
raylane.hf's `pp_stages` (strategy.pp = 2, 1F1B, 2 micro-batches), its weights read by rank 0 alone
(raylane.hf.load_pretrained: every stage's), then 3 SGD steps through the Trainer's own `run_step`
(packed {input_ids, labels} batches, transformers' causal-LM loss on the last stage, clipping over
both stages) beside `from_pretrained`'s model trained in one process on the same batches; then the
held-out loss through the Evaluator over 5 rows that 2 micro-batches do not divide. Cases: argv[3:]
("full", "lora"; both when none). Rank 0 writes {case: {"losses": [[pp, one], ...], "weights"
(largest difference over the largest weight), "eval": [pp, one], "reads" (per rank), "strategy",
"trained", "params"}} as JSON to argv[2]."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch
import torch.distributed as dist
import transformers
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from raylane.config import load_config
from raylane.hf.build import _predicted_tokens
from raylane.hf.lora import LoraSection, apply_lora
from raylane.hf.pipeline_parallel import causal_lm_stages
from raylane.hf.tensor_parallel import tp_plan
from raylane.hf.weights import empty_model, load_pretrained
from raylane.loop.distributed.parallelize import parallelize
from raylane.loop.evaluation import Evaluator
from raylane.loop.optim import build_optimizer
from raylane.loop.run import local_runtime, step_trainer
from raylane.loop.steps import Throughput

BATCH, LENGTH, STEPS = 4, 16, 3
SETS = ["model.tie_embeddings=false", "strategy.pp=2", "optim.name=sgd", "optim.lr=0.5", "optim.weight_decay=0"]
SETS += ["optim.warmup_steps=0", "optim.schedule=constant", f"train.batch_size={BATCH}", "mlflow.log_model=false"]


def whole_state(model) -> dict[str, torch.Tensor]:
    """Every stage's parameters, whole, by name (each rank holds its stages' only)."""
    mine = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, {k: v.detach().clone() for k, v in mine.items()})
    return {k: v for part in every for k, v in part.items()}


def batch(step: int, vocab: int, rows: int = BATCH) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, vocab, (rows, LENGTH), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


class _Batches:
    epochs_alike = True

    def batches_in_epoch(self, epoch: int) -> int:
        return 1000


def run(path: str, lora: bool, root: str) -> dict:
    more = [s for s in os.environ.get("HF_PP_SETS", "").split(",") if s]  # strategy.tp=2, say
    cfg = load_config("gpt-tiny", [*SETS, *more, f"run.storage_path={root}", f"run.name=hf-pp-{int(lora)}"])
    model = empty_model(path)
    adapter = LoraSection(r=4, dropout=0.0) if lora else None
    if adapter:
        model = apply_lora(model, adapter, base=path)
    runtime = local_runtime(cfg, lambda event: None)
    stages = causal_lm_stages()
    world = dist.get_world_size()
    model, strategy = parallelize(model, cfg, runtime.device, world, pp_stages=stages, tp_plan=tp_plan)
    reads, real = [], transformers.modeling_utils.safe_open
    transformers.modeling_utils.safe_open = lambda f, *a, **k: reads.append(str(f)) or real(f, *a, **k)
    try:
        load_pretrained(model, path)
    finally:
        transformers.modeling_utils.safe_open = real
    pipe = SimpleNamespace(loss_fn=None, step=None, optimizer=None)
    optimizer = build_optimizer(model, cfg, pipe)
    start = whole_state(model)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if adapter:
        reference = apply_lora(reference, adapter, base=path)
    reference.load_state_dict(start, strict=not adapter)  # the adapter as rank 0 started it
    one = build_optimizer(reference, cfg, pipe)
    trainer = step_trainer(cfg, runtime, pipe, model, _Batches(), optimizer, strategy, Throughput())
    vocab, losses = reference.config.vocab_size, []
    for s in range(STEPS):
        b = batch(s + 1, vocab)
        ours = float(trainer.run_step([b]))
        one.zero_grad()
        loss = reference(**b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], cfg.train.grad_clip_norm)
        one.step()
        losses.append([ours, loss.item()])
    trained, expected = whole_state(model), reference.state_dict()
    delta = max(float((trained[k] - expected[k]).abs().max()) for k in trained)
    scale = max(float(v.abs().max()) for v in expected.values())
    held = batch(99, vocab, rows=5)
    parts = [{k: v[:4] for k, v in held.items()}, {k: v[4:] for k, v in held.items()}]
    evaluator = Evaluator(parts, None, runtime.device, dist.get_world_size(), count=_predicted_tokens)
    with torch.no_grad():
        evaluated = evaluator(model)["loss"]
        expected_eval = float(reference(**held).loss)
    return {
        "strategy": strategy.label,
        "reads": reads,
        "losses": losses,
        "weights": delta / scale,
        "eval": [evaluated, expected_eval],
        "trained": sorted(k for k in trained if not torch.equal(trained[k], start[k])),
        "params": sorted(trained),
    }


def main() -> None:
    dist.init_process_group("gloo")
    path, out = sys.argv[1], {}
    with tempfile.TemporaryDirectory() as root:
        for name in sys.argv[3:] or ("full", "lora"):
            result = run(path, name == "lora", root)
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, result["reads"])
            out[name] = {**result, "reads": every}
    if dist.get_rank() == 0:
        with open(sys.argv[2], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
