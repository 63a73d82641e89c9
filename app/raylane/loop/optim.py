"""The optimizer and the learning-rate schedule of a run: the pipeline's own (`Pipeline.optimizer`,
`Pipeline.scheduler`) where it gives them, else raylane's, from `cfg.optim`.

raylane's optimizer puts no weight decay on biases and normalization weights (`param_groups`),
and uses the fused Adam(W) kernel where the parameters' device has one. Its schedule (`Schedule`)
is a `LambdaLR` over `lr_factor`, which checkpoints as its step count alone (the factor is
recomputed from the config), so a resume continues the same curve. Never imports Ray."""

from __future__ import annotations

import logging
import math
import re
from typing import Any

import torch

from raylane.config import BaseConfig, OptimSection
from raylane.loop import usercode

log = logging.getLogger("raylane")

# Modules whose every parameter is a normalization's scale or shift: torch's own, and (by name)
# a model's own RMSNorm/LayerNorm classes (Hugging Face's LlamaRMSNorm, T5LayerNorm). Their
# parameters are 1-D in every model we know; the type check covers a 2-D one all the same.
_NORMS = (
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.RMSNorm,
    torch.nn.LocalResponseNorm,
)


_NORM_NAME = re.compile(r"Norm(\d+d)?$")


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, _NORMS) or bool(_NORM_NAME.search(type(module).__name__))


def param_groups(model: torch.nn.Module, weight_decay: float, decay_norm_and_bias: bool = False) -> list[dict]:
    """The optimizer's parameter groups over `model.named_parameters()` (each tensor once, however
    many names a tied weight has) that train (requires_grad). Without decay, or with
    `decay_norm_and_bias`, one group of every parameter. Else two: decay on the parameters of 2
    dimensions or more (weights, embeddings), none on 1-D ones (biases, norms' scales) and on any
    parameter of a normalization layer, the rule of nanoGPT and Hugging Face's Trainer. An empty group is left out (DCP cannot place one
    in a checkpoint)."""
    # Frozen parameters (a LoRA run's base) are left out: no optimizer state, nothing in its checkpoint.
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    if not weight_decay or decay_norm_and_bias:
        return [{"params": params, "weight_decay": weight_decay}]
    of_norms = {id(p) for m in model.modules() if _is_norm(m) for p in m.parameters(recurse=False)}
    plain = [p for p in params if p.ndim < 2 or id(p) in of_norms]
    kept = {id(p) for p in plain}
    decayed = [p for p in params if id(p) not in kept]
    return [
        g
        for g in ({"params": decayed, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0})
        if g["params"]
    ]


def _fused(optimizer_cls: type, groups: list[dict], **options: Any) -> torch.optim.Optimizer:
    """Adam(W) with the fused kernel, else without it: torch refuses it for parameters on a device
    without one, or not floating point. On CUDA and on CPU alike: an AdamW step took 4.5 ms fused
    against 24 ms for-each and 26 ms torch's CPU default over 3.9M parameters, and 66 us against
    144 us for Linear(20, 1), on 2 CPU cores (torch 2.13). Not bit-identical to the unfused kernels
    (~1e-8 apart after 5 steps): the groups carry the choice (`fused`) in the checkpoint, and a
    resume goes on with the kernel the run started with."""
    try:
        optimizer = optimizer_cls(groups, fused=True, **options)
    except (RuntimeError, ValueError):
        optimizer = optimizer_cls(groups, **options)
    if _mixed(groups):
        optimizer.register_step_pre_hook(_one_by_one)
    return optimizer


def _mixed(groups: list[dict]) -> bool:
    """Whether a group holds DTensors beside plain tensors (DDP's replicas beside expert-parallel
    experts, strategy.ep), which the fused and for-each kernels refuse to take in one call."""
    import sys

    tensor = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists (its import costs ~1 s)
    if tensor is None:
        return False
    return any(len({isinstance(p, tensor.DTensor) for p in g["params"]}) > 1 for g in groups)


def _one_by_one(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    # Before each step, not once: a resumed checkpoint's groups bring back the kernel they ran with.
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = False, False


def build_optimizer(model: torch.nn.Module, cfg: BaseConfig, pipe: Any = None) -> torch.optim.Optimizer:
    """The pipeline's `optimizer(model, cfg)` where it gives one (its return checked), else raylane's.
    `model` is the parallelized one (DDP's wrapper, or FSDP2's module with DTensor parameters)."""
    own = getattr(pipe, "optimizer", None)
    if own is not None:
        optimizer = own(model, cfg)
        if (text := usercode.optimizer_problem(optimizer)) is not None:
            raise usercode.wrong_return(cfg, usercode.OPTIMIZER_ROLE, own, text)
        return optimizer
    o = cfg.optim
    groups = param_groups(model, o.weight_decay, o.decay_norm_and_bias)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
    return _fused(torch.optim.Adam if o.name == "adam" else torch.optim.AdamW, groups, lr=o.lr)


def lr_factor(step: int, o: OptimSection, total_steps: int) -> float:
    """The learning rate at `step` (0 before the first optimizer step), as a fraction of `optim.lr`:
    a linear warmup from lr/warmup_steps to lr, then `o.schedule` to lr x min_lr_ratio at
    `total_steps` (the lr after the last step). `wsd` holds lr until its decay, linear over the last
    `decay_fraction` of the steps, and never starts before the warmup has ended (a short run's
    decay is shortened, said once by `schedule_note`)."""
    warmup = o.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if o.schedule == "constant":
        return 1.0
    start = max(total_steps - max(round(o.decay_fraction * total_steps), 1), warmup) if o.schedule == "wsd" else warmup
    span = max(total_steps - start, 1)
    progress = min(max(step - start, 0), span) / span
    left = 0.5 * (1 + math.cos(math.pi * progress)) if o.schedule == "cosine" else 1 - progress
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * left


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: BaseConfig, total_steps: int, pipe: Any = None
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The pipeline's `scheduler(optimizer, cfg, total_steps)` where it gives one (its return
    checked; None: a constant lr), else raylane's (None for a constant lr without warmup)."""
    own = getattr(pipe, "scheduler", None)
    if own is not None:
        scheduler = own(optimizer, cfg, total_steps)
        if (text := usercode.scheduler_problem(scheduler, optimizer)) is not None:
            raise usercode.wrong_return(cfg, usercode.SCHEDULER_ROLE, own, text)
        return scheduler
    o = cfg.optim
    if o.schedule == "constant" and not o.warmup_steps:
        return None
    return Schedule(optimizer, o, total_steps)


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """raylane's schedule: `lr_factor` at each step, toward the run's last step. A resume whose
    steps per epoch changed moves that step (`set_total_steps`, from Trainer.load_state_dict).
    It checkpoints as LambdaLR does, its step count alone (the factor is recomputed from the
    config), so that a checkpoint of either loads into the other."""

    def __init__(self, optimizer: torch.optim.Optimizer, optim: OptimSection, total_steps: int) -> None:
        self.total_steps = total_steps  # before LambdaLR's first step, which reads it
        # A plain function: LambdaLR saves a callable object's attributes, and nothing of a function.
        super().__init__(optimizer, lambda step: lr_factor(step, optim, self.total_steps))

    def set_total_steps(self, total_steps: int) -> None:
        self.total_steps = total_steps

    def state_dict(self) -> dict[str, Any]:
        # The horizon is this launch's: a loaded one would be the launch's that saved it.
        state = super().state_dict()
        state.pop("total_steps", None)
        return state


def schedule_note(cfg: BaseConfig, total_steps: int, pipe: Any = None) -> str | None:
    """One line when raylane's schedule cannot run as configured in `total_steps` steps: a warmup
    as long as the run, or a `wsd` whose warmup and decay do not both fit (its decay is shortened)."""
    o = cfg.optim
    if getattr(pipe, "scheduler", None) is not None or (o.schedule == "constant" and not o.warmup_steps):
        return None
    if o.warmup_steps >= total_steps:
        return (
            f"optim.warmup_steps = {o.warmup_steps}: the run has {total_steps} steps, all of them in the "
            "warmup (the lr never reaches optim.lr)"
        )
    decay = max(round(o.decay_fraction * total_steps), 1)
    if o.schedule == "wsd" and o.warmup_steps + decay > total_steps:
        return (
            f"optim.schedule = 'wsd': optim.warmup_steps {o.warmup_steps} and the decay's {decay} steps "
            f"(optim.decay_fraction {o.decay_fraction}) are more than the run's {total_steps}: the decay starts "
            f"when the warmup ends and lasts {total_steps - o.warmup_steps} steps"
        )
    return None
