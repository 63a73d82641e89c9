"""Run under torchrun (gloo, CPU), 2 ranks: expert parallelism at ep 2 against one process, for a
tiny Qwen2-MoE (with its shared expert) and a tiny Mixtral (hidden 32, 2 layers, 4 experts,
top-2, fp32), made here from their configs with one seed. Each rank trains, with AdamW, a copy
whose experts are laid out by raylane.loop.distributed.expert_parallel (2 of the 4 per rank) and
whose dense part is under DDP, on its half of each batch; beside it, the same model whole in one
process on the whole batch. Per step: the loss (mean of the ranks'), every gradient (the expert
shards gathered) and the tokens per expert (summed over the ranks) against the one process's;
then the same with a router collapsed onto rank 1's experts (its weights zero and frozen: all
logits equal, and torch.topk's ties go to experts 2 and 3: rank 0 receives nothing), and a DCP
checkpoint of the ep 2 model read back whole. Writes
argv[1]/rank<r>.json. Also imported by tests/unit/test_expert_parallel.py for the tiny models."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
from torch import nn

EXPERTS = "model.layers.*.mlp.experts"
BATCH, SEQ, VOCAB = 4, 8, 64


def tiny_moe(family: str, seed: int = 0) -> nn.Module:
    """A tiny `family` (qwen2_moe or mixtral) causal LM, fp32, its weights from `seed`. Mixtral's
    experts run transformers' eager loop (only the experts routed to take part in the graph),
    Qwen2-MoE's the grouped matmul that transformers chooses on this torch."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig

    common = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    common |= {"num_key_value_heads": 2, "max_position_embeddings": 64, "num_experts_per_tok": 2}
    if family == "qwen2_moe":
        config = Qwen2MoeConfig(
            **common,
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_experts=4,
        )
    else:
        config = MixtralConfig(**common, intermediate_size=16, num_local_experts=4)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().train()
    if family == "mixtral":
        model.config._experts_implementation = "eager"  # read at each call by the experts' forward
    return model


def routed_counts(model: nn.Module) -> list[torch.Tensor]:
    """Per experts module, a counter the model's own routing fills (a forward pre-hook reading
    top_k_index): what one process routes, independent of the dispatch under test."""
    counts = []
    for name, m in model.named_modules():
        if name.endswith("mlp.experts"):
            count = torch.zeros(m.num_experts, dtype=torch.long)

            def hook(_m: nn.Module, args: tuple, c: torch.Tensor = count) -> None:
                c.add_(torch.bincount(args[1].reshape(-1), minlength=c.numel()))

            m.register_forward_pre_hook(hook)
            counts.append(count)
    return counts


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient by parameter name, an expert shard's gathered whole (a collective)."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        out[name.removeprefix("module.")] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    return out


def compare(family: str, steps: int, biased: bool, ckpt: str | None) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from raylane.loop.distributed import expert_parallel as ep

    rank, world = dist.get_rank(), dist.get_world_size()
    ref, mine = tiny_moe(family), tiny_moe(family)
    if biased:
        for m in (ref, mine):
            for name, p in m.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.data.zero_()
                    p.requires_grad_(False)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    laid = ep.apply_expert_parallel(mine, [EXPERTS], mesh["ep"])
    held = sum(p.to_local().numel() for n, p in mine.named_parameters() if n in ep.expert_parameter_names(mine))
    whole = sum(p.numel() for n, p in ref.named_parameters() if ".mlp.experts." in n)
    DDP._set_params_and_buffers_to_ignore_for_model(mine, ep.expert_parameter_names(mine))
    ddp = DDP(mine)
    counts = routed_counts(ref)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, mine)]
    gen = torch.Generator().manual_seed(1)
    loss_gap = grad_gap = load_gap = 0.0
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        for c in counts:
            c.zero_()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        half = ids[rank * BATCH // world : (rank + 1) * BATCH // world]
        loss = ddp(input_ids=half, labels=half).loss
        loss.backward()
        ep.reduce_expert_grads(mine, world)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        loss_gap = max(loss_gap, abs(mean.item() / world - ref_loss.item()))
        got, want = full_grads(mine), full_grads(ref)
        assert got.keys() == want.keys()
        grad_gap = max(grad_gap, max((got[n] - want[n]).abs().max().item() for n in want))
        loads = torch.stack(list(ep.expert_load(mine, reset=True).values()))
        dist.all_reduce(loads)
        load_gap = max(load_gap, (loads - torch.stack(counts)).abs().max().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    result = {"laid": laid, "held": held, "whole": whole, "loss_gap": loss_gap, "grad_gap": grad_gap}
    result |= {"load_gap": load_gap, "last_counts": torch.stack(counts).tolist()}
    gathered = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in mine.state_dict().items()}
    result["param_gap"] = max((gathered[n] - v).abs().max().item() for n, v in ref.state_dict().items())
    if ckpt:
        result["ckpt_gap"] = reread(mine, gathered, ckpt)
    return result


def reread(mine: nn.Module, gathered: dict[str, torch.Tensor], folder: str) -> float:
    """The ep 2 model saved by torch.distributed.checkpoint (each rank its experts), read into
    plain whole tensors on every rank: the largest difference from its parameters gathered."""
    import torch.distributed.checkpoint as dcp

    dcp.save(mine.state_dict(), checkpoint_id=folder)
    whole = {k: torch.zeros_like(v) for k, v in gathered.items()}
    dcp.load(whole, checkpoint_id=folder)
    return max((whole[k] - v).abs().max().item() for k, v in gathered.items())


def capped(capacity_factor: float = 1.0) -> dict:
    """A tiny Mixtral at ep 2, its routers collapsed onto rank 1's experts (2 and 3), with a
    capacity: one training forward and backward of each rank's 2 x 8 tokens. Its loss against one
    process's on the same tokens whose dropped pairs' weights are made 0 by a hook (each expert's
    first ceil(c * T*k / E) pairs in the batch's order kept: the rule, written again here); the
    loop's window figures on each rank and the run's summed over both (raylane.loop.observe.experts)."""
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from raylane.loop.distributed import expert_parallel as ep
    from raylane.loop.observe.experts import ExpertFigures

    rank, world = dist.get_rank(), dist.get_world_size()
    ref, mine = tiny_moe("mixtral"), tiny_moe("mixtral")
    for m in (ref, mine):
        for name, p in m.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.data.zero_()

    def masked(module: nn.Module, args: tuple) -> tuple:
        hidden, index, weights = args
        capacity, seen, keep = math.ceil(capacity_factor * index.numel() / module.num_experts), {}, []
        for e in index.reshape(-1).tolist():
            keep.append(seen.get(e, 0) < capacity)
            seen[e] = seen.get(e, 0) + 1
        return hidden, index, weights * torch.tensor(keep, dtype=weights.dtype).view_as(weights)

    for name, m in ref.named_modules():
        if name.endswith("mlp.experts"):
            m.register_forward_pre_hook(masked)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    ep.apply_expert_parallel(mine, [EXPERTS], mesh["ep"], capacity_factor=capacity_factor)
    figures = ExpertFigures.of(mine)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    half = ids[rank * BATCH // world : (rank + 1) * BATCH // world]
    loss = mine(input_ids=half, labels=half).loss
    loss.backward()
    gap = abs(loss.item() - ref(input_ids=half, labels=half).loss.item())
    window = figures.window(1.0)
    figures.reset()
    return {"loss_gap": gap, "window": window, "summary": figures.summary()}


def main() -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a hang fails in a minute
    out, steps = sys.argv[1], int(sys.argv[2])
    results, started = {}, time.perf_counter()
    for family in ("qwen2_moe", "mixtral"):
        ckpt = f"{out}/ckpt-{family}" if family == "qwen2_moe" else None
        results[family] = compare(family, steps, biased=False, ckpt=ckpt)
        results[f"{family} biased"] = compare(family, 2, biased=True, ckpt=None)
    results["capped"] = capped()
    results["seconds"] = time.perf_counter() - started
    with open(f"{out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
