"""The one place that decides how a model is distributed. Models know nothing of it: their
repeated layers, the unit of sharding, recompute and compilation, are the pipeline's `blocks`, or
else found in the model (raylane.loop.blocks: `model.blocks`, a Hugging Face model's
`_no_split_modules`, its largest repeated ModuleList). A model with none is sharded as one unit.

Order matters and follows torchtitan: tensor parallelism (the pipeline's tp_plan), activation
checkpointing, then compile, then DDP or FSDP2."""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raylane.config import BaseConfig
from raylane.loop.blocks import Blocks, blocks_of, find_blocks
from raylane.loop.devices import GIB, device_memory_bytes, local_world_size
from raylane.loop.layout import MESH_DIMS, Layout
from raylane.loop.tensor_parallel import (
    TpPlan,
    apply_plan,
    gather_when_evaluating,
    loss_context,
    plan_for,
    retie,
    shared_parameters,
)

log = logging.getLogger("raylane")

# DDP is chosen by `auto` when its estimate fits in this share of the device's memory: the
# rest is for the allocator's fragmentation, the CUDA context and kernels' workspaces.
AUTO_MARGIN = 0.85
OPTIMIZER_STATES = {"adam": 2, "adamw": 2}  # per parameter; SGD: 1 with momentum, else 0


@dataclass
class Strategy:
    """How `parallelize()` laid the model out on this run's ranks, and why: the name the summary,
    the terminal's strategy line and MLflow's tags show (`tags`), the device mesh's shape, the
    memory estimate an `auto` choice was made from, and which blocks FSDP, recompute or compile
    took. With tensor parallelism (`tp` > 1) the mesh is (data-parallel ranks, tp): consecutive
    ranks form a tensor-parallel group, which reads the same batches."""

    name: Literal["single", "ddp", "fsdp", "hsdp"]
    mesh_shape: tuple[int, ...] = ()
    reason: str = ""
    estimate: dict[str, int] | None = None
    blocks: str = ""  # the blocks FSDP, activation checkpointing or compile took, where any found and used
    tp: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    pp: int = 1
    pp_schedule: str = ""

    @property
    def layout(self) -> Layout:
        """The mesh's dimensions by name (raylane.loop.layout)."""
        return Layout.of(self)

    @property
    def label(self) -> str:
        """The layout as the summary, the strategy line and MLflow's tags name it: `fsdp×tp2×pp2`,
        or without the data-parallel flavour where one data-parallel rank holds the batch (`tp2`,
        `pp2`; `+sp`, `+lp`: sequence and loss parallel); `ddp`, `fsdp`, `hsdp` or `single`
        without model parallelism."""
        return self.layout.label()

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: those that read different batches (dp_replicate x dp_shard)."""
        return self.layout.data_parallel

    def step_context(self) -> Any:
        """What a training step's forward, loss and backward run in: torch's loss_parallel, whose
        cross-entropy takes the head's vocabulary-split logits, under loss parallelism."""
        return loss_context(self.tp > 1 and self.loss_parallel)

    def tags(self) -> dict[str, str]:
        tags = {"raylane.strategy": self.label, "raylane.strategy.reason": self.reason}
        if mesh := self.layout.mesh_text():
            tags["raylane.strategy.mesh"] = mesh
        if self.pp > 1:
            tags["raylane.strategy.pp_schedule"] = self.pp_schedule
        if self.blocks:
            tags["raylane.strategy.blocks"] = self.blocks
        if self.estimate:
            tags.update({f"raylane.memory_estimate.{k}_gb": f"{v / GIB:.3f}" for k, v in self.estimate.items()})
        return tags


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def activation_bytes(
    model: nn.Module, example: Any, loss_fn, checkpointed: bool = False, step=None, blocks: Any = None
) -> int:
    """Bytes autograd keeps for backward from one forward and loss at the example batch's size
    (any of the three forms, raylane.loop.batches), measured on a copy on the meta device:
    shapes only, no memory, no compute. With activation checkpointing, each block keeps only its
    input, and one block's are rebuilt at a time. `blocks`: the pipeline's (raylane.loop.blocks),
    or None to find them."""
    from raylane.loop.batches import forward_loss, to_device

    meta, blocks = copy.deepcopy((model, blocks_of(model, blocks)))  # one copy: the blocks are the copy's
    meta.to("meta")
    batch = to_device(example, torch.device("meta"))
    params = {id(p) for p in meta.parameters()}
    saved: dict[int, tuple[int, int]] = {}  # tensor id -> (bytes, block index or -1)
    keep: list[torch.Tensor] = []  # alive until the end, so an id is never reused
    inputs: list[int] = []
    where = [-1]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params and id(t) not in saved:
            saved[id(t)] = (t.numel() * t.element_size(), where[0])
            keep.append(t)
        return t

    def enter(i: int):
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            where[0] = i
            inputs.append(sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)))

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
        return Strategy("single", reason="one rank")
    nodes = _nodes(world_size)
    if (replicas := cfg.strategy.dp_replicate) > 1:  # checked before launch: it divides the world
        nodes = replicas
    sharded = ("hsdp", (nodes, world_size // nodes)) if nodes > 1 else ("fsdp", (world_size,))
    if cfg.strategy.name == "ddp":
        return Strategy("ddp", (world_size,), reason="strategy.name: ddp")
    if cfg.strategy.name == "fsdp":
        return Strategy(*sharded, reason="strategy.name: fsdp")
    estimate = estimate_memory(model, cfg, world_size, example, loss_fn, step, blocks=blocks)
    budget = device_memory_bytes(device, cfg.scaling.device_memory_gb, local_world_size())
    estimate["device"] = budget
    fits = estimate["ddp"] <= AUTO_MARGIN * budget
    why = (
        f"auto: DDP needs ~{estimate['ddp'] / GIB:.2f} GiB per rank, FSDP ~{estimate['fsdp'] / GIB:.2f} GiB, "
        f"of {budget / GIB:.2f} GiB per device ({AUTO_MARGIN:.0%} usable)"
    )
    if fits:
        return Strategy("ddp", (world_size,), reason=why, estimate=estimate)
    return Strategy(*sharded, reason=why, estimate=estimate)


def _auto_layout(
    cfg: BaseConfig, device: torch.device, world_size: int, model: nn.Module, probe: tuple, blocks: Any, plan: Any
) -> Strategy:
    """`strategy.tp: auto`: the simplest layout that fits the device (raylane.loop.layout.weigh).
    `probe`: (example, loss_fn, step), for the activations."""
    from raylane.loop.layout import weigh

    if world_size == 1:
        return Strategy("single", reason="one rank")
    o = cfg.optim
    example, loss_fn, step = probe
    estimate = estimate_memory(model, cfg, world_size, example, loss_fn, step, blocks=blocks)
    per_byte = 2 + OPTIMIZER_STATES.get(o.name, 1 if o.momentum else 0)  # parameters, gradients, states
    budget = device_memory_bytes(device, cfg.scaling.device_memory_gb, local_world_size())
    chosen, estimate, why = weigh(cfg, world_size, model, blocks, plan, estimate, per_byte, (budget, AUTO_MARGIN))
    if chosen.tp > 1:
        return replace(model_parallel_strategy(cfg, world_size, chosen.tp, why), estimate=estimate)
    if chosen.name == "ddp":
        return Strategy("ddp", (world_size,), reason=why, estimate=estimate)
    nodes = _nodes(world_size)
    if nodes > 1:
        return Strategy("hsdp", (nodes, world_size // nodes), reason=why, estimate=estimate)
    return Strategy("fsdp", (world_size,), reason=why, estimate=estimate)


def _nodes(world_size: int) -> int:
    local = local_world_size(default=world_size)  # unset: one node
    return world_size // local if 0 < local < world_size and world_size % local == 0 else 1


def _agreed(strategy: Strategy) -> Strategy:
    """Rank 0's choice on every rank: detected memory may differ between hosts."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [asdict(strategy)]
        dist.broadcast_object_list(box, src=0)
        return Strategy(**{**box[0], "mesh_shape": tuple(box[0]["mesh_shape"])})
    return strategy


def prepare_blocks(model: nn.Module, cfg: BaseConfig, blocks: Any = None) -> None:
    """In place, before any wrapping: activation checkpointing, then compile, on the model's
    blocks (the pipeline's, or found; compile takes the whole model when it has none)."""
    blocks = blocks_of(model, blocks)
    if cfg.train.activation_checkpointing:
        for block in blocks:
            _checkpoint_activations(block)
    if cfg.train.compile:
        for part in blocks or [model]:
            part.compile()  # in place: parameter names (and checkpoints) stay as they are


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
) -> tuple[nn.Module, Strategy]:
    """(the model ready to train on this rank, the strategy chosen). `blocks`: the pipeline's
    (None: found in the model). `blocks_prepared`: the caller already ran prepare_blocks on it.
    `tp_plan`: the pipeline's, for `strategy.tp` > 1; `pp_stages`, for `strategy.pp` > 1 (then the
    model is this rank's stages, a raylane.loop.pipeline_parallel.PipelineModel)."""
    found = find_blocks(model, blocks)
    blocks = found.modules
    if cfg.strategy.pp > 1:
        strategy = model_parallel_strategy(cfg, world_size)
        _note_blocks(model, found, strategy, cfg)
        return _pipeline_parallel(model, found, cfg, device, strategy, tp_plan, pp_stages, loss_fn), strategy
    if cfg.strategy.tp == "auto":
        strategy = _agreed(_auto_layout(cfg, device, world_size, model, (example, loss_fn, step), blocks, tp_plan))
    elif cfg.strategy.tp > 1:
        strategy = model_parallel_strategy(cfg, world_size)
    else:
        strategy = _agreed(choose_strategy(cfg, device, world_size, model, example, loss_fn, step, blocks=blocks))
    _note_blocks(model, found, strategy, cfg)
    if strategy.tp > 1:
        return lay_out_tensor_parallel(model, blocks, cfg, device, strategy, tp_plan), strategy
    if not blocks_prepared:
        prepare_blocks(model, cfg, blocks)
    if strategy.name in ("fsdp", "hsdp"):
        return fully_shard(model, blocks, cfg, device, strategy), strategy
    model = materialize(model, device) if on_meta(model) else model.to(device)
    if strategy.name == "single":
        return model, strategy  # DDP on one rank only adds hooks and a broadcast
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


def model_parallel_strategy(cfg: BaseConfig, world_size: int, tp: int | None = None, why: str = "") -> Strategy:
    """The (pp, dp_replicate, dp_shard, cp, tp) layout of `world_size` ranks (dp_shard: the rest);
    `tp`: the degree `tp: auto` chose, with `why`."""
    s = cfg.strategy
    tp, pp, replicate, cp = tp or s.tp_degree, s.pp, s.dp_replicate, s.cp
    if world_size % (tp * pp * replicate * cp):  # checked before launch (raylane.prechecks.check_layout)
        raise ValueError(
            f"strategy.pp x dp_replicate x tp = {pp * replicate * tp}: does not divide the {world_size} ranks"
        )
    shard = world_size // (tp * pp * replicate * cp)
    dp = replicate * shard
    said = [f"strategy.tp: {tp}"] if tp > 1 else []
    if pp > 1:
        said.append(
            f"strategy.pp: {pp} ({s.pp_schedule}, {s.microbatches} micro-batches, {pp * s.stages_per_rank} stages)"
        )
    reason = why or f"{', '.join(said)}, FSDP2 over {dp} data-parallel rank{'s' if dp > 1 else ''}"
    return Strategy(
        "fsdp",
        (pp, replicate, shard, cp, tp),
        reason=reason,
        tp=tp,
        sequence_parallel=s.sequence_parallel,
        loss_parallel=s.loss_parallel,
        pp=pp,
        pp_schedule=s.pp_schedule if pp > 1 else "",
    )


def device_mesh(device: torch.device, shape: tuple[int, ...]) -> Any:
    """The run's one mesh over (pp, dp_replicate, dp_shard, cp, tp), size-1 dims kept, with flattened
    views: `batch` (dp_replicate x dp_shard: who reads which data), `fsdp` (dp_shard x cp: FSDP2's
    shards) and `loss` (batch x cp: over whom the loss averages)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, tuple(shape), mesh_dim_names=MESH_DIMS)
    # torch keeps flattened views apart from the mesh (slicing them from it is deprecated)
    mesh.views = {  # type: ignore[attr-defined]
        "batch": mesh["dp_replicate", "dp_shard"]._flatten("batch"),
        "fsdp": mesh["dp_shard", "cp"]._flatten("fsdp"),
        "loss": mesh["dp_replicate", "dp_shard", "cp"]._flatten("loss"),
    }
    return mesh


def fsdp_mesh(mesh: Any) -> Any:
    """FSDP2's mesh in a model-parallel layout: the shards, or (replicas, shards) for HSDP."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]  # (with context parallelism: dp_shard x cp, flattened)
    return mesh.views["fsdp"]


def lay_out_tensor_parallel(
    model: nn.Module, blocks: list[nn.Module], cfg: BaseConfig, device: torch.device, strategy: Strategy, plan: Any
) -> nn.Module:
    """The plan on each tensor-parallel group, then recompute and compile, then FSDP2 over the
    data-parallel ranks: over one rank too, so that every parameter is a DTensor (torch's fused
    optimizers and its clipping take no plain tensors beside DTensors)."""
    if plan is None:
        raise ValueError(
            f"strategy.tp = {strategy.tp}: the pipeline gives no tp_plan (which layers tensor parallelism "
            "splits): give its Pipeline a tp_plan (docs/strategies.md, Tensor parallelism)"
        )
    mesh = device_mesh(device, strategy.mesh_shape)
    if not on_meta(model):
        model = model.to(device)
    apply_plan(
        model, plan, mesh["tp"], sequence_parallel=strategy.sequence_parallel, loss_parallel=strategy.loss_parallel
    )
    if strategy.loss_parallel:
        gather_when_evaluating(model)
    prepare_blocks(model, cfg, blocks)
    return fully_shard(model, blocks, cfg, device, strategy, fsdp_mesh(mesh))


def _pipeline_parallel(
    model: nn.Module, found: Blocks, cfg: BaseConfig, device: torch.device, strategy: Strategy, plan, stages, loss_fn
) -> nn.Module:
    """This rank's pipeline stages, each in issue 49's order: the split (on the model as built, on
    the meta device or not), the TP plan and its ties, recompute and compile, FSDP2 (over one rank
    too: every parameter a DTensor, so a checkpoint is sharded by stage), then storage."""
    from raylane.loop.pipeline_parallel import pipeline_model, stage_plan

    mesh = device_mesh(device, strategy.mesh_shape)
    rules = plan_for(model, plan, sequence_parallel=strategy.sequence_parallel) if strategy.tp > 1 else None

    def prepare(stage: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        if rules is not None:  # the plan's rules for the modules this stage holds
            from torch.distributed.tensor.parallel import parallelize_module

            ties = shared_parameters(stage)
            parallelize_module(stage, mesh["tp"], stage_plan(stage, rules))
            retie(stage, ties)
        prepare_blocks(stage, cfg, blocks)
        return fully_shard(stage, blocks, cfg, device, strategy, fsdp_mesh(mesh))

    return pipeline_model(model, found, cfg.strategy, device, mesh["pp"], prepare, stages, loss_fn)


def _checkpoint_activations(block: nn.Module) -> None:
    # Patching forward (rather than wrapping the block) keeps parameter names unchanged.
    from torch.utils.checkpoint import checkpoint

    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


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


def fully_shard(
    model: nn.Module,
    blocks: list[nn.Module],
    cfg: BaseConfig,
    device: torch.device,
    strategy: Strategy,
    mesh: Any = None,
) -> nn.Module:
    """FSDP2 on each block, then the root; a 2-D mesh (replicate across nodes, shard inside
    one) is HSDP. `mesh`: the data-parallel ranks' (under tensor parallelism), else made here."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as shard

    if mesh is None:
        names = ("replicate", "shard") if len(strategy.mesh_shape) == 2 else ("shard",)
        mesh = init_device_mesh(device.type, strategy.mesh_shape, mesh_dim_names=names)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
    }
    meta = on_meta(model)
    if cfg.strategy.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    elif not meta:
        model = model.to(device)
    # Under a pipeline schedule, blocks stay gathered between micro-batches (torchtitan's default):
    # resharding would all-gather them again for every micro-batch.
    reshard = cfg.strategy.reshard_after_forward and strategy.pp == 1
    for block in blocks:
        shard(block, reshard_after_forward=reshard, **options)
    # The root's parameters (embeddings, head) are used last in backward: keep them gathered.
    shard(model, reshard_after_forward=False, **options)
    if meta:  # sharded first: each rank allocates its own shards only
        materialize(model, torch.device("cpu") if cfg.strategy.cpu_offload else device)
    return model


def on_meta(model: nn.Module) -> bool:
    """Whether the model was built on the meta device (shapes, no memory): its weights come
    from the pipeline's init_weights or a checkpoint, after it is parallelized."""
    return any(p.is_meta for p in model.parameters())


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """A meta model's storage on `device`, uninitialized (`to_empty`), keeping what to_empty
    loses: buffers built real (a model made with accelerate's `init_empty_weights(include_buffers=
    False)` keeps non-persistent buffers such as rotary frequencies, which no state dict holds),
    and parameters shared under several names (tied embeddings), which to_empty would split."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    ties = shared_parameters(model)
    model.to_empty(device=device)
    retie(model, ties)
    with torch.no_grad():
        for name, value in buffers.items():
            model.get_buffer(name).copy_(value)
    return model


def resharded(model: nn.Module) -> nn.Module:
    """The model with every FSDP2 module's parameters back in their shards, as an optimizer must
    be built over: a forward without backward (a pipeline's init_weights checking its weights, a
    probe) leaves the root's unsharded (it is not resharded after forward), and an optimizer built
    then holds those, which FSDP2 swaps out at the next step: their weights never train (issue
    49's trap c)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def no_gradient_sync(model: nn.Module):
    """A context for micro-batches before the last of an optimizer step: gradients accumulate
    locally and are reduced once, on the last micro-batch (the DDP paper's skipped sync)."""
    if isinstance(model, DDP):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(model)
    import contextlib

    return contextlib.nullcontext()


class _fsdp_no_sync:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.model.set_requires_gradient_sync(False)

    def __exit__(self, *exc: object) -> None:
        self.model.set_requires_gradient_sync(True)
