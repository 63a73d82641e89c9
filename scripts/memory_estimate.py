"""Prints raylane's per-rank memory estimate (raylane.loop.distributed.parallelize.estimate_memory: parameters,
gradients, optimizer state, one micro-batch's activations) for a config, as JSON, to set beside a
run's measured peak (`memory.peak_bytes` in its summary):

    python scripts/memory_estimate.py pipelines/gpt2-124m.yaml --set train.batch_size=8 [--world N]

The model is built by the pipeline on this machine's CPU; the activations are measured on a meta
copy (shapes only)."""

from __future__ import annotations

import argparse
import json

from raylane import api
from raylane.loop.data.loader import first_batch
from raylane.loop.distributed.parallelize import estimate_memory
from raylane.loop.usercode import build_pipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--world", type=int, default=1, help="ranks the estimate divides FSDP's state by")
    args = parser.parse_args()
    cfg = api.check(args.config, args.overrides)
    pipe = build_pipeline(cfg)
    example = first_batch(pipe.train_set, cfg.train.batch_size, pipe.collate_fn)
    estimate = estimate_memory(pipe.model, cfg, args.world, example, pipe.loss_fn, pipe.step, blocks=pipe.blocks)
    print(json.dumps(estimate))


if __name__ == "__main__":
    main()
