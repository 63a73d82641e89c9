"""The shipped hf pipeline (raylane.hf.pipeline) with a hook that says, on each rank, what of the
experts it holds once the model is laid out: `held.out`/held-<rank>.json with the experts
modules' parameter bytes on this rank (`held`) and whole (`whole`), whether any of them trains,
and the names of the parameters that do. Read by tests/e2e/test_expert_export.py."""

from __future__ import annotations

import json
from pathlib import Path

import raylane
import raylane.hf


class Held(raylane.Section):
    out: raylane.OutputPath


class Config(raylane.hf.Config):
    held: Held


class HeldBytes(raylane.Hook):
    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def setup(self, ctx: raylane.HookContext) -> None:
        from torch.distributed.tensor import DTensor

        held = whole = 0
        experts_train = False
        for _, module in ctx.model.named_modules():
            if not hasattr(module, "ep_experts") and type(module).__name__ not in ("Qwen2MoeExperts", "MixtralExperts"):
                continue
            for p in module.parameters(recurse=False):
                local = p.to_local() if isinstance(p, DTensor) else p
                held += local.numel() * local.element_size()
                whole += p.numel() * p.element_size()
                experts_train |= p.requires_grad
        trains = sorted(n for n, p in ctx.model.named_parameters() if p.requires_grad)
        self.out.mkdir(parents=True, exist_ok=True)
        record = {"held": held, "whole": whole, "experts_train": experts_train, "trains": trains}
        (self.out / f"held-{ctx.rank}.json").write_text(json.dumps(record))


def build(cfg: Config):
    pipe = raylane.hf.pipeline(cfg)
    pipe.hooks = [*pipe.hooks, HeldBytes(str(cfg.held.out))]
    return pipe
