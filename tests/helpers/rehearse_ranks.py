"""Run under torchrun (4 gloo ranks) by tests/unit/test_rehearse_ranks.py: a small gpt laid out for
real by raylane's parallelize on each rank, its weights allocated on the CPU, for each layout named
in argv (`name:set,set,...` of --set overrides). Rank 0 writes {layout: {"bytes": [each rank's
parameter bytes], "dp_shard": FSDP2's shards}} as JSON to the path in $REHEARSE_OUT."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from raylane.config import load_config
from raylane.loop.distributed.parallelize import parallelize
from raylane.pipelines.gpt import build

# Every parameter's dim 0 divides 4 and 256 ranks' shards alike (no padding on either side): 256
# wide, 4 heads, 512 rows of vocabulary, 128 positions, no biases.
MODEL = [
    "model.n_embd=256",
    "model.n_head=4",
    "model.n_layer=4",
    "model.vocab_size=512",
    "model.block_size=128",
    "model.bias=false",
    "model.tie_embeddings=false",
    "strategy.name=fsdp",
]


def held_bytes(sets: list[str]) -> tuple[int, int]:
    """(this rank's parameter bytes, FSDP2's shards) under the layout `sets` asks for."""
    cfg = load_config("gpt-tiny", [*MODEL, *sets])
    pipe = build(cfg)
    model, strategy = parallelize(
        pipe.model,
        cfg,
        torch.device("cpu"),
        dist.get_world_size(),
        loss_fn=pipe.loss_fn,
        blocks=pipe.blocks,
        tp_plan=pipe.tp_plan,
        pp_stages=pipe.pp_stages,
    )
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total, strategy.layout.dp_shard


def main() -> None:
    dist.init_process_group("gloo")
    out = {}
    for spec in sys.argv[1:]:
        name, _, sets = spec.partition(":")
        mine, shards = held_bytes([s for s in sets.split(",") if s])
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        out[name] = {"bytes": every, "dp_shard": shards}
    if dist.get_rank() == 0:
        with open(os.environ["REHEARSE_OUT"], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
