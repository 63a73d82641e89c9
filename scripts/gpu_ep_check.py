"""The expert-parallel path at ep 1 on one device (issue 65): a `save_pretrained` mixture of experts
(examples/moe/make_moe.py's Qwen2-MoE) whose experts modules are laid out by raylane's
apply_expert_parallel on a one-rank ep mesh (the pairs sorted by expert, the counts and the rows
through all_to_all_single over the device's backend, the experts' own forward on their local
shards, the results weighted and summed back), against the same model trained plainly, on the
same batches, AdamW both: each one's losses, the largest gap, the median step time (the first
steps left out) and the peak memory. Exit 1 when the losses part by more than --tol.

One process: NCCL on a GPU (a machine with one GPU cannot run two NCCL ranks), gloo on CPU.

    python scripts/gpu_ep_check.py MODEL_DIR [--steps 10] [--batch 8] [--seq-len 256] [--tol 1e-4]"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

EXPERTS = ["model.layers.*.mlp.experts"]  # transformers' own plan for Qwen2-MoE (base_model_ep_plan)


def _train(model, batches, device, lr: float) -> tuple[list[float], float, int]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)  # DTensor experts beside plain tensors
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for ids in batches:
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))  # a host sync: the step's time is the device's
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return losses, statistics.median(times[2:] or times), peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a save_pretrained folder of a transformers MoE (examples/moe/make_moe.py)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tol", type=float, default=1e-4, help="largest loss gap allowed, relative")
    args = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from raylane.loop.distributed.expert_parallel import apply_expert_parallel, expert_load

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, device_id=device if cuda else None)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).train()
    laid = copy.deepcopy(plain)
    names = apply_expert_parallel(laid, EXPERTS, init_device_mesh(device.type, (1,), mesh_dim_names=("ep",))["ep"])
    vocab = plain.config.vocab_size
    batches = [torch.randint(0, vocab, (args.batch, args.seq_len), device=device) for _ in range(args.steps)]
    ep, ep_s, ep_peak = _train(laid, batches, device, args.lr)
    base, base_s, base_peak = _train(plain, batches, device, args.lr)
    gap = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ep, base, strict=True))
    tokens = {name: int(count.sum()) for name, count in expert_load(laid).items()}
    report = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "backend": dist.get_backend(),
        "experts_modules": names,
        "pairs_routed": tokens,  # every (token, choice) pair of every step: steps x batch x seq x top-k
        "losses_ep1": ep,
        "losses_plain": base,
        "largest_relative_gap": gap,
        "step_ms_ep1": ep_s * 1e3,
        "step_ms_plain": base_s * 1e3,
        "peak_gib_ep1": ep_peak / 2**30,
        "peak_gib_plain": base_peak / 2**30,
    }
    print(json.dumps(report, indent=1))
    dist.destroy_process_group()
    expected = args.steps * args.batch * args.seq_len * plain.config.num_experts_per_tok
    ok = gap <= args.tol and all(n == expected for n in tokens.values())
    print(
        f"gpu_ep_check: {'ok' if ok else 'FAILED'}: losses within {gap:.2e} (tol {args.tol:g}); "
        f"{len(names)} experts modules, {expected} pairs each routed; step {ep_s * 1e3:.1f} vs {base_s * 1e3:.1f} ms"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
