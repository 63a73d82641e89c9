"""A rehearsal's figures besides the ranks' shares (raylane.loop.rehearsal.ranks): one rank's
activations, measured on a meta forward with the tp plan laid out (raylane.loop.distributed.
parallelize.activation_bytes, what `strategy.tp: auto` weighs), a rank's memory against its GPU,
the step's estimated time, what a checkpoint writes per save and what MLflow records per logging
window, each from the code that does it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raylane.loop.distributed.devices import size_text
from raylane.loop.distributed.layout import Layout
from raylane.loop.rehearsal.ranks import Share, local_bytes, playing
from raylane.loop.rehearsal.target import MFU, Target

# Activations kept by a pipeline stage, by schedule: GPipe runs every micro-batch's forward
# before any backward; 1F1B and the interleaved and zero-bubble schedules keep at most pp - stage
# micro-batches in flight (torch.distributed.pipelining's schedules; Narayanan et al. 2021).
ALL_IN_FLIGHT = ("GPipe",)


class _FusedSavings(torch.autograd.Function):
    """Attention as a fused kernel keeps it for backward (flash and memory-efficient SDPA, which a
    GPU runs): q, k, v, the output and a log-sum-exp per query, not the (T, T) scores and weights
    that the math path, the only one the meta device runs, keeps (2 GiB a layer at 4,096 tokens)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # never run: the forward is measured only
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class _FusedAttention(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")][len(args) :])[:3]
            return _FusedSavings.apply(q, k, v)
        return func(*args, **kwargs)


def activations(pipe: Any, cfg: Any, target: Target, layout: Layout, example: Any) -> int | None:
    """One micro-batch's activations on one rank with the tp plan laid out over a fake mesh (the
    whole model's: a pipeline stage takes its share, `stage_activations`), attention's as a fused
    kernel keeps them (`_FusedSavings`); halved in 16-bit precision, as raylane's memory estimate
    takes them. None where the model's forward does not
    run on the meta device or there is no example batch (a stream's)."""
    from raylane.loop.distributed.fake import fake_mesh, fake_work
    from raylane.loop.distributed.parallelize import activation_bytes
    from raylane.loop.distributed.tensor_parallel import apply_plan

    if example is None:
        return None
    checkpointed = cfg.train.activation_checkpointing
    with playing(0, target), fake_work():
        lay = None
        if layout.tp > 1 and pipe.tp_plan is not None:
            mesh = fake_mesh(Layout("fsdp", dp_shard=target.world // layout.tp, tp=layout.tp))

            def lay(meta: torch.nn.Module) -> None:
                apply_plan(meta, pipe.tp_plan, mesh["tp"], sequence_parallel=layout.sequence_parallel)

        try:
            with _FusedAttention():
                acts = activation_bytes(pipe.model, example, pipe.loss_fn, checkpointed, pipe.step, pipe.blocks, lay)
        except Exception:  # noqa: BLE001 - an op without a meta kernel, a step that reads values
            return None
    return acts if cfg.train.precision == "fp32" else acts // 2


def stage_activations(acts: int, share: Share, layout: Layout, cfg: Any, n_blocks: int, held: int) -> int:
    """A pipeline stage's activations: its blocks' share of one micro-batch's, times the
    micro-batches it keeps in flight (ALL_IN_FLIGHT's: all; else pp - its pipeline rank)."""
    if layout.pp == 1:
        return acts
    s = cfg.strategy
    pp_rank = share.rank // (layout.world_size // layout.pp)
    flight = s.microbatches if s.pp_schedule in ALL_IN_FLIGHT else min(s.microbatches, layout.pp - pp_rank)
    return acts * held // max(n_blocks, 1) * flight


@dataclass
class Memory:
    """One rank's bytes: parameters, gradients, optimizer state, what the layout holds besides
    (FSDP's gathered blocks, DDP's buckets) and activations."""

    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int | None
    besides: str = "gathered"  # FSDP's gathered blocks, or DDP's gradient buckets

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.gathered + (self.activations or 0)

    def text(self, device: int) -> str:
        acts = "activations not measured" if self.activations is None else f"activations {size_text(self.activations)}"
        parts = (
            f"parameters {size_text(self.params)}, gradients {size_text(self.grads)}, "
            f"optimizer {size_text(self.optimizer)}, {self.besides} {size_text(self.gathered)}, {acts}"
        )
        return f"{size_text(self.total)} of {size_text(device)} ({self.total / device:.0%}): {parts}"


def memory(share: Share, cfg: Any, largest_block: int, acts: int | None, padded: Share | None = None) -> Memory:
    """`share`'s bytes under `cfg`: gradients as the trainable parameters' (FSDP2 keeps them in the
    shards' dtype), the optimizer's states per trainable parameter (raylane.loop.distributed.
    parallelize.OPTIMIZER_STATES: AdamW's two, in the shards' fp32), under FSDP two blocks gathered
    in the compute precision (one in use, one prefetched) over tp, under DDP its gradient buckets.
    `padded`: the first shard of `share`'s stage, whose size FSDP2 gives every shard's parameter
    and gradient storage (it pads dim 0 to a multiple of the shards: a rank past the rows holds
    padding), while the optimizer's states are the local shard's."""
    from raylane.loop.distributed.parallelize import OPTIMIZER_STATES

    o, layout = cfg.optim, share.layout
    states = OPTIMIZER_STATES.get(o.name, 1 if o.momentum else 0)
    if layout.name in ("ddp", "single"):
        buckets = 0 if cfg.strategy.gradient_as_bucket_view or layout.name == "single" else share.trainable_bytes
        gathered = buckets
    else:
        half = cfg.train.precision != "fp32"
        gathered = 2 * largest_block // layout.tp // (2 if half else 1)
    params, grads = share.param_bytes, share.trainable_bytes
    if padded is not None and layout.name not in ("ddp", "single"):
        params, grads = max(params, padded.param_bytes), max(grads, padded.trainable_bytes)
    besides = "buckets" if layout.name in ("ddp", "single") else "gathered"
    return Memory(params, grads, states * share.trainable_bytes, gathered, acts, besides)


def short_rows(model: torch.nn.Module, shards: int, tp: int) -> list[str]:
    """The parameters (folded over blocks, `layers.*.experts.w`) with fewer rows than FSDP2's
    `shards` in dim 0 once tp took its share, and in every other dimension (raylane splits one
    short in dim 0 on another: raylane.loop.distributed.fsdp.spread_placement): ranks past those
    rows hold padding for them."""
    import re

    seen: dict[str, int] = {}
    for name, p in model.named_parameters():
        if p.dim() and max(p.shape[0] // tp, 1) < shards and max(p.shape[1:], default=0) < shards:
            seen.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name, count=1), p.shape[0])
    return [f"{name} ({rows})" for name, rows in seen.items()]


def step_seconds(flops_per_token: float, tokens: int, target: Target, precision: str) -> float:
    """A step's time at MFU of the target's peak: its FLOPs (forward and backward per token, the
    pipeline's count, times tokens per step) over world x peak x MFU. Leaves out what MFU does not
    hold: a pipeline's bubble, communication not overlapped, the data's wait."""
    return flops_per_token * tokens / (target.world * (target.peak_flops(precision) or float("inf")) * MFU)


def checkpoint_files(layout: Layout, world: int) -> tuple[int, str]:
    """(files per save, how): a sharded state (FSDP, tp, pp) is torch.distributed.checkpoint's, one
    data file per rank (`__<rank>_0.distcp`, FileSystemWriter's single file per rank) and its
    `.metadata`, beside each rank's random generators (`rng_<rank>.json`) and the manifest
    (raylane.loop.checkpoint.writing); a replicated one (DDP, one process) is rank 0's `state.pt`
    and the manifest."""
    if layout.name in ("ddp", "single") and not layout.model_parallel:
        return 2, "state.pt and manifest.json, by rank 0"
    return 2 * world + 2, (
        f"{world} shard files (__<rank>_0.distcp), {world} rng_<rank>.json, .metadata and manifest.json "
        f"(which lists {2 * world + 1} files)"
    )


def window_entries(world: int, nodes: list[str], throughput: Any, samples_per_step: int) -> dict[str, int]:
    """MLflow's metrics at one logging window at `world` ranks, counted from the loop's own code:
    the Trainer's train/* (raylane.loop.steps.MetricsWindow, with a gradient norm and the
    throughput's tokens and MFU) and the gathered step times' steps/* (raylane.loop.observe.
    steptimes.window_figures over `world` ranks' rows): {prefix: count}."""
    from raylane.loop.observe.steptimes import window_figures
    from raylane.loop.steps import MetricsWindow

    window = MetricsWindow(torch.device("cpu"))
    window.add(torch.tensor(1.0))
    window.grad_norm = torch.tensor(1.0)
    train = window.metrics(samples_per_step, 1e-4, throughput, world)
    # each rank's (steps, step s, data s, arrival, compute s, optimizer s), as the vote gathers them
    rows: list[tuple[float, ...]] = [(1.0, 1.0 + i / world, 0.01, 0.5, 0.9, 0.1) for i in range(world)]
    steps = window_figures(rows, nodes).get("metrics", {})
    return {"train/*": len(train), "steps/*": len(steps)}


def model_bytes(model: torch.nn.Module) -> int:
    return local_bytes(model.parameters())
