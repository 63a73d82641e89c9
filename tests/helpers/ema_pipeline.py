"""A user's pipeline (tests copy it into their tmp dir as pipe.py) for held-out sets, early
stopping and hooks: a linear regression on fixed data. `model.named_sets`: two named held-out
sets (`val`, `test`) rather than one. `model.hooks`: which hooks it gives, from `ema` (the
exponential moving average docs/pipelines.md quotes), `record` (writes each call it gets to
calls-<rank>.json in the working directory) and `boom` (raises at step 2).

The class `EMA` is quoted verbatim in docs/pipelines.md (tests/e2e/test_eval_hooks.py checks it)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import raylane


class Model(raylane.Section):
    named_sets: bool = False
    hooks: tuple[str, ...] = ()
    ema_decay: float = 0.9


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self):
        return ("val/loss", "test/loss") if self.model.named_sets else ("loss",)


# -- the docs' example: begin ------------------------------------------------------------------
class EMA(raylane.Hook):
    """An exponential moving average of the weights: updated after every step, saved in every
    checkpoint, and evaluated after every evaluation (logged as ema/<metric>)."""

    def __init__(self, decay: float = 0.999) -> None:
        self.decay = decay
        self.shadow: dict[str, torch.Tensor] = {}

    def setup(self, ctx: raylane.HookContext) -> None:
        # ctx.model is the model on its device, unwrapped from DDP (under FSDP, each parameter
        # is a DTensor: its average is one too, this rank's shard).
        self.shadow = {name: p.detach().clone() for name, p in ctx.model.named_parameters()}

    @torch.no_grad()
    def on_step_end(self, ctx: raylane.HookContext) -> None:
        for name, p in ctx.model.named_parameters():
            self.shadow[name].lerp_(p.detach(), 1 - self.decay)

    @torch.no_grad()
    def on_eval_end(self, ctx: raylane.HookContext) -> None:
        params = dict(ctx.model.named_parameters())
        trained = {name: p.detach().clone() for name, p in params.items()}
        for name, p in params.items():
            p.copy_(self.shadow[name])
        try:
            metrics = ctx.evaluate()  # collective: every rank evaluates the averaged weights
        finally:
            for name, p in params.items():
                p.copy_(trained[name])
        ctx.log({f"ema/{k}": v for k, v in metrics.items()})

    def state_dict(self) -> dict:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        for name, tensor in state["shadow"].items():
            self.shadow[name].copy_(tensor)


# -- the docs' example: end --------------------------------------------------------------------


class Record(raylane.Hook):
    """Every call it gets, as JSON in calls-<rank>.json (rewritten at each call)."""

    def __init__(self) -> None:
        self.calls: dict[str, list] = {"setup": [], "step_end": [], "eval_end": [], "checkpoint": []}

    def _write(self, ctx, kind: str, value) -> None:
        self.calls[kind].append(value)
        Path(f"calls-{ctx.rank}.json").write_text(json.dumps({**self.calls, "world_size": ctx.world_size}))

    def setup(self, ctx) -> None:
        self._write(ctx, "setup", ctx.step)

    def on_step_end(self, ctx) -> None:
        self._write(ctx, "step_end", [ctx.step, sorted(ctx.metrics)])

    def on_eval_end(self, ctx) -> None:
        self._write(ctx, "eval_end", [ctx.step, ctx.metrics])

    def on_checkpoint(self, ctx) -> None:
        self._write(ctx, "checkpoint", [ctx.step, ctx.checkpoint])


class Boom(raylane.Hook):
    def on_step_end(self, ctx) -> None:
        if ctx.step == 2:
            raise ValueError(f"the hook broke at step {ctx.step}")


def data(rows: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(rows, 1, generator=g))


def build(cfg: Config) -> raylane.Pipeline:
    m = cfg.model
    hooks = {"ema": lambda: EMA(m.ema_decay), "record": Record, "boom": Boom}
    eval_set = {"val": data(16, 1), "test": data(24, 2)} if m.named_sets else data(16, 1)
    return raylane.Pipeline(
        model=torch.nn.Linear(4, 1),
        train_set=data(48, 0),
        eval_set=eval_set,
        loss_fn=torch.nn.functional.mse_loss,
        eval_sums=lambda out, y: {"loss": torch.nn.functional.mse_loss(out, y, reduction="sum")},
        hooks=[hooks[name]() for name in m.hooks],
    )
