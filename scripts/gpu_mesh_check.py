"""The model-parallel path at tp=1, pp=1 on one device: the pipeline's model laid out by raylane's
tensor-parallel path (its tp_plan applied on a one-rank (pp, dp_replicate, dp_shard, cp, tp) mesh,
then compile and FSDP2, every parameter a DTensor) against the same model trained plainly, with
the same batches; prints each one's losses, step time and peak memory, and raylane's estimate.
One process (NCCL on a GPU, gloo on CPU): a GPU machine with one GPU cannot run two NCCL ranks.

    python scripts/gpu_mesh_check.py pipelines/gpt2-124m.yaml --set train.batch_size=8 [--steps 8]"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
import torch.distributed as dist

from raylane import api
from raylane.loop.data.loader import first_batch
from raylane.loop.distributed.fsdp import prepare_blocks
from raylane.loop.distributed.parallelize import estimate_memory, model_parallel_strategy
from raylane.loop.distributed.tensor_parallel import lay_out_tensor_parallel
from raylane.loop.protocols.batches import forward_loss, to_device
from raylane.loop.usercode import build_pipeline


def _train(model, pipe, batches, cfg, device) -> tuple[list[float], float, int]:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for batch in batches:
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss, _, _ = forward_loss(model, to_device(batch, device), pipe.loss_fn, pipe.step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach().float()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return losses, sorted(times[2:])[len(times[2:]) // 2] if len(times) > 2 else times[-1], peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    cfg = api.check(args.config, [*args.overrides, f"scaling.use_gpu={str(cuda).lower()}"])
    torch.manual_seed(0)
    pipe = build_pipeline(cfg)
    loader = torch.utils.data.DataLoader(pipe.train_set, batch_size=cfg.train.batch_size, shuffle=False)
    batches = [b for _, b in zip(range(args.steps), loader, strict=False)]
    example = first_batch(pipe.train_set, cfg.train.batch_size, pipe.collate_fn)
    est = estimate_memory(pipe.model, cfg, 1, example, pipe.loss_fn, pipe.step, blocks=pipe.blocks)
    plain = copy.deepcopy(pipe.model).to(device)
    prepare_blocks(plain, cfg, None)
    out = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "estimate": est}
    out["plain"] = dict(zip(("losses", "step_s", "peak_bytes"), _train(plain, pipe, batches, cfg, device), strict=True))
    del plain
    if cuda:
        torch.cuda.empty_cache()
    strategy = model_parallel_strategy(cfg, 1, tp=1)
    mesh_model = lay_out_tensor_parallel(
        copy.deepcopy(pipe.model), pipe.blocks or [], cfg, device, strategy, pipe.tp_plan
    )
    out["mesh"] = dict(
        zip(("losses", "step_s", "peak_bytes"), _train(mesh_model, pipe, batches, cfg, device), strict=True)
    )
    out["mesh"]["strategy"], out["mesh"]["mesh_shape"] = strategy.label, list(strategy.mesh_shape)
    out["max_loss_difference"] = max(
        abs(a - b) for a, b in zip(out["plain"]["losses"], out["mesh"]["losses"], strict=True)
    )
    print(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
