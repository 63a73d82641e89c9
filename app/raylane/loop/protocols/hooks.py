"""Hooks: a pipeline's own code at step ends, evaluation ends and checkpoints (`Pipeline.hooks`).

They are called inside the Trainer, on every rank, under every launcher (Ray, torchrun, one
process), at the same steps on every rank: a hook may take part in collectives (`ctx.evaluate()`
is one). A hook's `state_dict()` is saved in each checkpoint with the model and the optimizer and
handed back to `load_state_dict()` on resume. An exception in a hook fails the run with one line
naming the hook's method and the place (raylane.loop.usercode). Ray-free."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# The methods a hook may define, as error messages name them (raylane.loop.usercode).
METHODS = ("setup", "on_step_end", "on_eval_end", "on_checkpoint", "state_dict", "load_state_dict")


class Hook:
    """Subclass it and define what you need; every method is optional.

    - `setup(ctx)`: once, before training and before a resume loads the hook's state, with the
      model already parallelized on its device (create tensors shaped like its parameters here).
    - `on_step_end(ctx)`: after every optimizer step; `ctx.metrics` holds rank 0's train metrics
      at the steps they are logged (`mlflow.log_every_n_steps`), else is empty.
    - `on_eval_end(ctx)`: after every evaluation, with its metrics in `ctx.metrics`.
    - `on_checkpoint(ctx)`: once a checkpoint is committed; `ctx.checkpoint` is its location.
    - `state_dict()` / `load_state_dict(state)`: the hook's state, saved in every checkpoint
      (tensors, numbers, strings, lists and dicts of them; a sharded model's DTensors too).
      `state_dict()` must give the same keys and shapes after `setup` as it will at a save: a
      sharded checkpoint is loaded into it in place."""

    def setup(self, ctx: HookContext) -> None:
        pass

    def on_step_end(self, ctx: HookContext) -> None:
        pass

    def on_eval_end(self, ctx: HookContext) -> None:
        pass

    def on_checkpoint(self, ctx: HookContext) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@dataclass
class HookContext:
    """What a hook is called with. `model` is the model as trained, unwrapped from DDP (under
    FSDP its parameters are DTensors: each rank holds its shard)."""

    rank: int
    world_size: int
    step: int
    epoch: int
    model: Any
    optimizer: Any
    metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: str | None = None
    _log: Callable[[dict[str, float], int], None] | None = None
    _evaluate: Callable[[], dict[str, float]] | None = None

    def log(self, metrics: dict[str, float]) -> None:
        """Log `metrics` to MLflow at this step, under the names given (rank 0; a no-op elsewhere)."""
        if self._log is not None:
            self._log({k: float(v) for k, v in metrics.items()}, self.step)

    def evaluate(self) -> dict[str, float]:
        """Evaluate the model as it is now on the held-out set(s), named as the run's eval metrics
        ({} without a held-out set). Collective: every rank must call it, at the same step. The
        model is back in train mode after."""
        return self._evaluate() if self._evaluate is not None else {}


class Hooks:
    """The pipeline's hooks, called in order. `trainer` gives the context's figures (a
    raylane.loop.trainer.Trainer; duck-typed to keep this module free of it)."""

    def __init__(self, hooks: Sequence[Any], trainer: Any) -> None:
        self.hooks = list(hooks or ())
        self.trainer = trainer

    def __bool__(self) -> bool:
        return bool(self.hooks)

    def context(self, **extra: Any) -> HookContext:
        """The context now; `extra` sets its other fields (a checkpoint's step and location)."""
        t = self.trainer
        fields = {
            "rank": t.runtime.rank,
            "world_size": t.runtime.world_size,
            "step": t.step,
            "epoch": t.epoch,
            "model": getattr(t.model, "module", t.model),  # DDP's wrapped model
            "optimizer": t.optimizer,
            "_evaluate": t.evaluation.measure,
            "_log": t.reporter.log_metrics if t.reporter.active else None,
        }
        return HookContext(**{**fields, **extra})

    def call(self, method: str, **extra: Any) -> None:
        if not self.hooks:
            return
        ctx = self.context(**extra)
        for hook in self.hooks:
            fn = getattr(hook, method, None)
            if fn is not None:
                fn(ctx)

    # -- state, saved with the checkpoint ------------------------------------------------------

    def keys(self) -> list[str]:
        return [f"{i}.{type(hook).__name__}" for i, hook in enumerate(self.hooks)]

    def state_dict(self) -> dict[str, Any]:
        """{hook key: its state} for the hooks that have any."""
        out = {}
        for key, hook in zip(self.keys(), self.hooks, strict=True):
            state = hook.state_dict() if hasattr(hook, "state_dict") else None
            if state:
                out[key] = state
        return out

    def load_state_dict(self, states: dict[str, Any]) -> None:
        for key, hook in zip(self.keys(), self.hooks, strict=True):
            if key in states and hasattr(hook, "load_state_dict"):
                hook.load_state_dict(states[key])
