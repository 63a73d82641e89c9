"""Run under torchrun by tests/e2e/test_pipeline_parallel.py: gpt-tiny (untied, 4 blocks) under
pipeline-parallel layouts, each rank beside an unsharded copy trained in-process on the whole
global batch (issue 49's study, section 3.1). For each layout named in argv (`name:set,set,...`
of --set overrides; a name starting "meta": the model built on the meta device), 3 SGD steps through the Trainer's own `run_step`; then the held-out sums
through the Evaluator, over a batch the micro-batches do not divide. Rank 0 writes
{layout: {"losses", "reference", "weights" (largest relative difference), "eval", "eval_reference",
"strategy"}} as JSON to the path in $PIPELINE_OUT."""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from raylane.config import load_config
from raylane.loop.distributed.parallelize import parallelize
from raylane.loop.evaluation import Evaluator
from raylane.loop.optim import build_optimizer
from raylane.loop.run import local_runtime, step_trainer
from raylane.loop.steps import Throughput
from raylane.pipelines.gpt import build

BASE = [
    "model.tie_embeddings=false",
    "model.n_layer=4",
    "optim.name=sgd",
    "optim.lr=0.3",
    "optim.weight_decay=0",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
    "train.batch_size=8",
    "mlflow.log_model=false",
]
STEPS = 3


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def run_layout(sets: list[str], world: int, root: str, meta: bool = False) -> dict:
    """`meta`: the model is built on the meta device (no weights), split and sharded so, then
    given the reference's weights by name (what a pipeline's init_weights does)."""
    cfg = load_config("gpt-tiny", [*BASE, *sets, f"run.storage_path={root}", "run.name=pp"])
    torch.manual_seed(0)
    pipe = build(cfg)
    reference = copy.deepcopy(pipe.model)
    if meta:
        from raylane.pipelines.gpt import build_model

        with torch.device("meta"):
            pipe.model = build_model(cfg.model)
    runtime = local_runtime(cfg, lambda event: None)
    model, strategy = parallelize(
        pipe.model, cfg, runtime.device, world, loss_fn=pipe.loss_fn, tp_plan=pipe.tp_plan, pp_stages=pipe.pp_stages
    )
    if meta:
        _fill(model, dict(reference.named_parameters()))
    optimizer = build_optimizer(model, cfg, pipe)
    ref_opt = build_optimizer(reference, cfg, pipe)
    trainer = step_trainer(cfg, runtime, pipe, model, _Batches(), optimizer, strategy, Throughput())
    dp, dp_rank = strategy.data_parallel, strategy.layout.data_rank(dist.get_rank())
    b, accum = cfg.train.batch_size, cfg.train.grad_accum_steps
    gen = torch.Generator().manual_seed(1)
    losses, expected = [], []
    for _ in range(STEPS):
        # accum micro-batches of the global batch (dp x b rows each); this rank reads its dp share
        whole = [pipe.train_set[int(i)] for i in torch.randint(len(pipe.train_set), (accum * dp * b,), generator=gen)]
        xs, ys = torch.stack([w[0] for w in whole]), torch.stack([w[1] for w in whole])
        mine = [
            (
                xs[(a * dp + dp_rank) * b : (a * dp + dp_rank + 1) * b],
                ys[(a * dp + dp_rank) * b : (a * dp + dp_rank + 1) * b],
            )
            for a in range(accum)
        ]
        losses.append(float(trainer.run_step(mine)))
        ref_opt.zero_grad()
        mean = 0.0
        for a in range(accum):
            x, y = xs[a * dp * b : (a + 1) * dp * b], ys[a * dp * b : (a + 1) * dp * b]
            loss = pipe.loss_fn(reference(x), y)
            (loss / accum).backward()
            with torch.no_grad():  # rank 0's own loss: its share's
                mean += float(pipe.loss_fn(reference(mine[a][0]), mine[a][1])) / accum
        torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.train.grad_clip_norm)
        ref_opt.step()
        expected.append(mean)
    # The largest difference over the largest weight: a bias whose gradient is zero in theory
    # (k_proj's: softmax ignores it) stays at float noise, which no per-tensor ratio can take.
    theirs = dict(reference.named_parameters())
    delta = scale = 0.0
    for name, p in model.named_parameters():
        ref = theirs[name].detach()
        delta = max(delta, float((_full(p.detach()) - ref).abs().max()))
        scale = max(scale, float(ref.abs().max()))
    worst = delta / scale
    held = [pipe.eval_set[i] for i in range(11)]  # 8 rows, then 3: not a multiple of the micro-batches
    batches = [(torch.stack([h[0] for h in part]), torch.stack([h[1] for h in part])) for part in (held[:8], held[8:])]
    evaluator = Evaluator(batches, pipe.eval_sums, runtime.device, world, loss_fn=pipe.loss_fn)
    evaluated = evaluator(model)
    with torch.no_grad():
        sums = [pipe.eval_sums(reference(x), y) for x, y in batches]
    eval_reference = {k: sum(float(s[k]) for s in sums) / 11 for k in sums[0]}
    return {
        "losses": losses,
        "reference": expected,
        "weights": worst,
        "eval": evaluated,
        "eval_reference": eval_reference,
        "strategy": strategy.label,
    }


@torch.no_grad()
def _fill(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Each parameter's shard of the named weight (FSDP2's Shard(0) over the data-parallel ranks)."""
    from torch.distributed.tensor import distribute_tensor

    for name, p in model.named_parameters():
        p.copy_(distribute_tensor(weights[name].detach(), p.device_mesh, p.placements))


class _Batches:
    """The trainer's data, which it only counts: the batches are given to run_step here."""

    epochs_alike = True

    def batches_in_epoch(self, epoch: int) -> int:
        return 1000


def main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for spec in sys.argv[1:]:
            name, _, sets = spec.partition(":")
            out[name] = run_layout([s for s in sets.split(",") if s], world, root, meta=name.startswith("meta"))
    if dist.get_rank() == 0:
        with open(os.environ["PIPELINE_OUT"], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
