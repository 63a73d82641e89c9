"""The one place that decides how a model is distributed. Models know nothing of it: their
repeated layers, the unit of sharding, recompute and compilation, are the pipeline's `blocks`, or
else found in the model (raylane.loop.distributed.blocks: `model.blocks`, a Hugging Face model's
`_no_split_modules`, its largest repeated ModuleList). A model with none is sharded as one unit.

Order matters and follows torchtitan: tensor parallelism (the pipeline's tp_plan), activation
checkpointing, then compile, then DDP or FSDP2. The layout chosen is one Layout (raylane.loop.
distributed.layout), held by the Strategy record (raylane.loop.distributed.fsdp, with FSDP2's
wrapping); tensor parallelism and pipeline stages are laid out by raylane.loop.distributed.
tensor_parallel and pipeline_parallel; what `tp: auto` weighs is raylane.loop.distributed.auto."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raylane.config import BaseConfig
from raylane.loop.distributed.blocks import Blocks, blocks_of, find_blocks
from raylane.loop.distributed.devices import (
    AUTO_MARGIN,
    OPTIMIZER_STATES,
    device_memory_bytes,
    local_world_size,
    size_text,
)
from raylane.loop.distributed.fsdp import Strategy, fully_shard, materialize, on_meta, prepare_blocks
from raylane.loop.distributed.layout import Layout
from raylane.loop.distributed.pipeline_parallel import lay_out_pipeline_parallel
from raylane.loop.distributed.tensor_parallel import TpPlan, lay_out_tensor_parallel

log = logging.getLogger("raylane")

_Choice = TypeVar("_Choice")


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _local_bytes(t: torch.Tensor) -> int:
    """A tensor's bytes on this rank: a DTensor's local share (a tensor-parallel layout's)."""
    if hasattr(t, "to_local"):
        with torch.no_grad():
            t = t.to_local()
    return t.numel() * t.element_size()


def activation_bytes(
    model: nn.Module,
    example: Any,
    loss_fn,
    checkpointed: bool = False,
    step=None,
    blocks: Any = None,
    lay_out: Callable[[nn.Module], None] | None = None,
) -> int:
    """Bytes autograd keeps for backward from one forward and loss at the example batch's size
    (any of the three forms, raylane.loop.protocols.batches), measured on a copy on the meta device:
    shapes only, no memory, no compute. With activation checkpointing, each block keeps only its
    input, and one block's are rebuilt at a time. `blocks`: the pipeline's (raylane.loop.distributed.blocks),
    or None to find them. `lay_out(copy)`: a layout applied to the meta copy first (a
    tensor-parallel plan over a fake process group): one rank's bytes under it."""
    from raylane.loop.distributed.fake import meta_copy
    from raylane.loop.protocols.batches import forward_loss, to_device

    meta, blocks = meta_copy(model, blocks)
    if lay_out is not None:
        lay_out(meta)
    batch = to_device(example, torch.device("meta"))
    params = {id(p) for p in meta.parameters()}
    saved: dict[int, tuple[int, int]] = {}  # tensor id -> (bytes, block index or -1)
    keep: list[torch.Tensor] = []  # alive until the end, so an id is never reused
    inputs: list[int] = []
    where = [-1]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params and id(t) not in saved:
            saved[id(t)] = (_local_bytes(t), where[0])
            keep.append(t)
        return t

    def enter(i: int):
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            where[0] = i
            inputs.append(sum(_local_bytes(a) for a in args if isinstance(a, torch.Tensor)))

        return hook

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(enter(i))
        block.register_forward_hook(lambda *_: where.__setitem__(0, -1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_loss(meta, batch, loss_fn, step)
    outside = sum(n for n, b in saved.values() if b < 0)
    per_block = [sum(n for n, b in saved.values() if b == i) for i in range(len(blocks))]
    if checkpointed and blocks:
        return outside + sum(inputs) + max(per_block)
    return outside + sum(per_block)


def estimate_memory(
    model: nn.Module, cfg: BaseConfig, world_size: int, example: Any, loss_fn, step=None, blocks: Any = None
) -> dict[str, int]:
    """Per-rank bytes under DDP and under FSDP: parameters, gradients, optimizer state and the
    activations of one micro-batch (plus DDP's gradient buckets, FSDP's gathered blocks). A
    model or step the meta device cannot run is estimated without its activations."""
    params = _nbytes(model.parameters())
    o = cfg.optim
    states = OPTIMIZER_STATES.get(o.name, 1 if o.momentum else 0)
    state = params * (2 + states)  # parameters, gradients, optimizer state
    acts = 0
    blocks = blocks_of(model, blocks)
    if example is not None:
        try:
            acts = activation_bytes(
                model, example, loss_fn, checkpointed=cfg.train.activation_checkpointing, step=step, blocks=blocks
            )
        except Exception as exc:  # noqa: BLE001 - an op with no meta kernel, a step that reads values
            log.debug(
                "the memory estimate leaves out activations: the model does not run on the meta device (%s: %s)",
                type(exc).__name__,
                exc,
            )
    if cfg.train.precision != "fp32":
        acts //= 2  # roughly: autocast keeps most activations in 16 bits
    largest_block = max((_nbytes(b.parameters()) for b in blocks), default=params)
    buckets = 0 if cfg.strategy.gradient_as_bucket_view else params
    return {
        "ddp": state + acts + buckets,
        "fsdp": state // world_size + acts + 2 * largest_block,  # one block gathered, one prefetched
        "activations": acts,
    }


def choose_strategy(
    cfg: BaseConfig,
    device: torch.device,
    world_size: int,
    model: nn.Module,
    example: Any,
    loss_fn,
    step=None,
    blocks: Any = None,
) -> Strategy:
    if world_size == 1:
        return Strategy(Layout("single"), reason="one rank")
    nodes = _nodes(world_size)
    if (replicas := cfg.strategy.dp_replicate) > 1:  # checked before launch: it divides the world
        nodes = replicas
    sharded = Layout.data_parallel_of("fsdp", world_size, replicas=nodes)  # HSDP across nodes
    if cfg.strategy.name == "ddp":
        return Strategy(Layout.data_parallel_of("ddp", world_size), reason="strategy.name: ddp")
    if cfg.strategy.name == "fsdp":
        return Strategy(sharded, reason="strategy.name: fsdp")
    estimate = estimate_memory(model, cfg, world_size, example, loss_fn, step, blocks=blocks)
    budget = device_memory_bytes(device, cfg.scaling.device_memory_gb, local_world_size())
    estimate["device"] = budget
    fits = estimate["ddp"] <= AUTO_MARGIN * budget
    why = (
        f"auto: DDP needs ~{size_text(estimate['ddp'])} per rank, FSDP ~{size_text(estimate['fsdp'])}, "
        f"of {size_text(budget)} per device ({AUTO_MARGIN:.0%} usable)"
    )
    if fits:
        return Strategy(Layout.data_parallel_of("ddp", world_size), reason=why, estimate=estimate)
    return Strategy(sharded, reason=why, estimate=estimate)


def _auto_layout(
    cfg: BaseConfig, device: torch.device, world_size: int, model: nn.Module, probe: tuple, blocks: Any, plan: Any
) -> Strategy:
    """`strategy.tp: auto`: the simplest layout that fits the device (raylane.loop.distributed.auto.weigh).
    `probe`: (example, loss_fn, step), for the activations."""
    from raylane.loop.distributed.auto import weigh

    if world_size == 1:
        return Strategy(Layout("single"), reason="one rank")
    o = cfg.optim
    example, loss_fn, step = probe
    estimate = estimate_memory(model, cfg, world_size, example, loss_fn, step, blocks=blocks)
    per_byte = 2 + OPTIMIZER_STATES.get(o.name, 1 if o.momentum else 0)  # parameters, gradients, states
    budget = device_memory_bytes(device, cfg.scaling.device_memory_gb, local_world_size())

    def activations(lay_out: Callable[[nn.Module], None]) -> int:
        """One rank's activations under a tensor-parallel candidate, counted as estimate_memory's."""
        checkpointed = cfg.train.activation_checkpointing
        acts = activation_bytes(model, example, loss_fn, checkpointed, step, blocks, lay_out=lay_out)
        return acts if cfg.train.precision == "fp32" else acts // 2

    measure = activations if example is not None and estimate["activations"] else None
    chosen, estimate, why = weigh(
        cfg, world_size, model, blocks, plan, estimate, per_byte, (budget, AUTO_MARGIN), activations=measure
    )
    if chosen.tp > 1:
        return replace(model_parallel_strategy(cfg, world_size, chosen.tp, why), estimate=estimate)
    layout = Layout.data_parallel_of(chosen.name, world_size, replicas=_nodes(world_size))
    return Strategy(layout, reason=why, estimate=estimate)


def _auto_ep(
    model: nn.Module,
    cfg: BaseConfig,
    device: torch.device,
    world_size: int,
    strategy: Strategy,
    probe: tuple,
    blocks,
    plan,
) -> int:
    """`strategy.ep: auto`'s degree (raylane.loop.distributed.expert_auto), rank 0's on every
    rank; its line joins the strategy's reason."""
    from raylane.loop.distributed.expert_auto import choose_ep

    example, loss_fn, step = probe
    estimate = estimate_memory(model, cfg, world_size, example, loss_fn, step, blocks=blocks)
    ep, why = _agreed(choose_ep(model, plan, cfg, world_size, strategy.name, estimate, device))
    strategy.reason = f"{strategy.reason}; {why}" if strategy.reason else why
    return ep


def _nodes(world_size: int) -> int:
    local = local_world_size(default=world_size)  # unset: one node
    return world_size // local if 0 < local < world_size and world_size % local == 0 else 1


def _agreed(choice: _Choice) -> _Choice:
    """Rank 0's choice on every rank: detected memory may differ between hosts. Not on torch's
    fake backend (a rehearsal plays each rank in one process, and a fake broadcast sends nothing)."""
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        box = [choice]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return choice


def model_parallel_strategy(cfg: BaseConfig, world_size: int, tp: int | None = None, why: str = "") -> Strategy:
    """The (pp, dp_replicate, dp_shard, cp, tp) layout of `world_size` ranks that the config asks
    for (checked before launch: raylane.layout_checks), and why; `tp`: the degree `tp: auto`
    chose, with `why`."""
    s = cfg.strategy
    layout = Layout.model_parallel_of(s, world_size, tp=tp)
    said = [f"strategy.tp: {layout.tp}"] if layout.tp > 1 else []
    if layout.pp > 1:
        said.append(
            f"strategy.pp: {layout.pp} ({s.pp_schedule}, {s.microbatches} micro-batches, "
            f"{layout.pp * s.stages_per_rank} stages)"
        )
    dp = layout.data_parallel
    reason = why or f"{', '.join(said)}, FSDP2 over {dp} data-parallel rank{'s' if dp > 1 else ''}"
    return Strategy(layout, reason=reason, pp_schedule=s.pp_schedule if layout.pp > 1 else "")


def parallelize(
    model: nn.Module,
    cfg: BaseConfig,
    device: torch.device,
    world_size: int,
    *,
    example: Any = None,
    loss_fn=None,
    step=None,
    blocks: Any = None,
    blocks_prepared: bool = False,
    tp_plan: TpPlan | None = None,
    pp_stages: Any = None,
    ep_plan: Any = None,
) -> tuple[nn.Module, Strategy]:
    """(the model ready to train on this rank, the strategy chosen). `blocks`: the pipeline's
    (None: found in the model). `blocks_prepared`: the caller already ran prepare_blocks on it.
    `tp_plan`: the pipeline's, for `strategy.tp` > 1; `pp_stages`, for `strategy.pp` > 1 (then the
    model is this rank's stages, a raylane.loop.distributed.pipeline_parallel.PipelineModel);
    `ep_plan`, for `strategy.ep` > 1 (raylane.loop.distributed.expert_layout)."""
    found = find_blocks(model, blocks)
    blocks = found.modules
    if cfg.strategy.pp > 1:
        strategy = model_parallel_strategy(cfg, world_size)
        _note_blocks(model, found, strategy, cfg)
        return lay_out_pipeline_parallel(model, found, cfg, device, strategy, tp_plan, pp_stages, loss_fn), strategy
    if cfg.strategy.tp == "auto":
        strategy = _agreed(_auto_layout(cfg, device, world_size, model, (example, loss_fn, step), blocks, tp_plan))
    elif cfg.strategy.tp > 1:
        strategy = model_parallel_strategy(cfg, world_size)
    else:
        strategy = _agreed(choose_strategy(cfg, device, world_size, model, example, loss_fn, step, blocks=blocks))
    _note_blocks(model, found, strategy, cfg)
    if strategy.tp > 1:
        return lay_out_tensor_parallel(model, blocks, cfg, device, strategy, tp_plan), strategy
    experts, ep = None, cfg.strategy.ep
    if ep == "auto":
        ep = _auto_ep(model, cfg, device, world_size, strategy, (example, loss_fn, step), blocks, ep_plan)
    if ep > 1 and device.type != "meta":  # a rehearsal's meta run has no process group
        from raylane.loop.distributed.expert_layout import lay_out_experts

        experts = lay_out_experts(
            model, ep_plan, ep, world_size, device, capacity_factor=cfg.strategy.ep_capacity_factor
        )
        strategy.layout, strategy.experts = replace(strategy.layout, ep=experts.ep), experts.describe(model)
    if not blocks_prepared:
        prepare_blocks(model, cfg, blocks)
    if strategy.name in ("fsdp", "hsdp"):
        return fully_shard(model, blocks, cfg, device, strategy, experts=experts), strategy
    model = materialize(model, device) if on_meta(model) else model.to(device)
    # DDP on one rank only adds hooks and a broadcast; on the meta device (a rehearsal's, raylane.
    # loop.rehearsal) its wrapper would check and broadcast values there are none of.
    if strategy.name == "single" or device.type == "meta":
        return model, strategy
    if experts is not None:
        from raylane.loop.distributed.expert_layout import keep_out_of_ddp

        keep_out_of_ddp(model, experts)
    return _ddp(model, cfg, device), strategy


_noted: set[str] = set()


def _note_blocks(model: nn.Module, found: Blocks, strategy: Strategy, cfg: BaseConfig) -> None:
    """The blocks on the strategy (its tags, the terminal's strategy line) where anything uses
    them; with none, one line on rank 0 saying what that means instead, once per process."""
    effects = {
        "FSDP shards the whole model as one unit": strategy.name in ("fsdp", "hsdp"),
        "activation checkpointing recomputes nothing": cfg.train.activation_checkpointing,
        "compile takes the whole model as one graph": cfg.train.compile,
    }
    uses = [what for what, used in effects.items() if used]
    if not uses:
        return
    if found.modules:
        strategy.blocks = found.describe()
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    note = (
        f"no repeated blocks found in {type(model).__name__}: {', '.join(uses)} (give the pipeline "
        f"blocks=[...] or blocks='path.to.layers' to choose them; docs/pipelines.md, Blocks)"
    )
    if rank == 0 and note not in _noted:
        _noted.add(note)
        log.warning(note)


def _ddp(model: nn.Module, cfg: BaseConfig, device: torch.device) -> DDP:
    s = cfg.strategy
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=s.bucket_cap_mb,
        gradient_as_bucket_view=s.gradient_as_bucket_view,
        static_graph=s.static_graph,
        find_unused_parameters=s.find_unused_parameters,
    )
    if s.comm_hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if s.comm_hook == "powersgd":
            # Plain all-reduce for the first steps, as PowerSGD's authors advise. Its error
            # feedback is not checkpointed: a resumed run starts it afresh.
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=s.powersgd_rank, start_powerSGD_iter=10
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            hook = default_hooks.fp16_compress_hook if s.comm_hook == "fp16" else default_hooks.bf16_compress_hook
            ddp.register_comm_hook(None, hook)
    return ddp
