"""How a model is held on its ranks, below the choice of layout: the `Strategy` record that
raylane.loop.distributed.parallelize.parallelize returns (its Layout and why it was chosen),
recompute and compile on the blocks (`prepare_blocks`), FSDP2 (`fully_shard`), a meta-device
model's storage (`on_meta`, `materialize`), and what the loop does with a wrapped model
(`resharded`, `unwrap`, `no_gradient_sync`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from raylane.config import BaseConfig
from raylane.loop.distributed.blocks import blocks_of
from raylane.loop.distributed.devices import GIB
from raylane.loop.distributed.layout import Layout
from raylane.loop.distributed.ties import retie, shared_parameters


@dataclass
class Strategy:
    """How `parallelize()` laid the model out on this run's ranks (`layout`: the one Layout
    everything reads) and why: the reason the strategy line and MLflow's tags give (`tags`), the
    memory estimate an `auto` choice was made from, which blocks FSDP, recompute or compile took,
    and the pipeline schedule under pipeline parallelism."""

    layout: Layout
    reason: str = ""
    estimate: dict[str, int] | None = None
    blocks: str = ""  # the blocks FSDP, activation checkpointing or compile took, where any found and used
    pp_schedule: str = ""
    experts: str = ""  # how the experts lie (strategy.ep): raylane.loop.distributed.expert_layout.Experts.describe

    @property
    def name(self) -> str:
        """How the data-parallel ranks hold the model: single, ddp, fsdp or hsdp."""
        return self.layout.name

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    @property
    def loss_parallel(self) -> bool:
        return self.layout.loss_parallel

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh's shape, as the summary's `mesh` gives it (raylane.loop.distributed.layout)."""
        return self.layout.mesh_shape

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
        """What a training step's forward, loss and backward run in (the layout's: torch's
        loss_parallel under loss parallelism)."""
        return self.layout.step_context()

    def tags(self) -> dict[str, str]:
        tags = {"raylane.strategy": self.label, "raylane.strategy.reason": self.reason}
        if mesh := self.layout.mesh_text():
            tags["raylane.strategy.mesh"] = mesh
        if self.pp > 1:
            tags["raylane.strategy.pp_schedule"] = self.pp_schedule
        if self.blocks:
            tags["raylane.strategy.blocks"] = self.blocks
        if self.experts:
            tags["raylane.strategy.experts"] = self.experts
        if self.estimate:
            tags.update({f"raylane.memory_estimate.{k}_gb": f"{v / GIB:.3f}" for k, v in self.estimate.items()})
        return tags


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


def _checkpoint_activations(block: nn.Module) -> None:
    # Patching forward (rather than wrapping the block) keeps parameter names unchanged.
    from torch.utils.checkpoint import checkpoint

    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def fully_shard(
    model: nn.Module,
    blocks: list[nn.Module],
    cfg: BaseConfig,
    device: torch.device,
    strategy: Strategy,
    mesh: Any = None,
    experts: Any = None,
) -> nn.Module:
    """FSDP2 on each block, then the root; HSDP over a (replicas, shards) mesh. `mesh`: FSDP2's
    part of the run's mesh (under model parallelism), else the layout's made here. `experts`:
    split over ranks (strategy.ep), each experts module an FSDP2 unit of its own first."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as shard

    if mesh is None:
        mesh = strategy.layout.device_mesh(device.type)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    options: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
        "shard_placement_fn": spread_placement(mesh.size(-1) if mesh.ndim > 1 else mesh.size()),
    }
    meta = on_meta(model)
    if cfg.strategy.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    elif not meta:
        model = model.to(device)
    # Under a pipeline schedule, blocks stay gathered between micro-batches (torchtitan's default):
    # resharding would all-gather them again for every micro-batch.
    reshard = cfg.strategy.reshard_after_forward and strategy.pp == 1
    if experts is not None:
        from raylane.loop.distributed.expert_layout import shard_experts_fsdp

        shard_experts_fsdp(model, experts, options, reshard)
    for block in blocks:
        shard(block, reshard_after_forward=reshard, **options)
    # The root's parameters (embeddings, head) are used last in backward: keep them gathered.
    shard(model, reshard_after_forward=False, **options)
    if meta:  # sharded first: each rank allocates its own shards only
        materialize(model, torch.device("cpu") if cfg.strategy.cpu_offload else device)
    return model


def spread_placement(shards: int) -> Callable[[nn.Parameter], Any]:
    """FSDP2's `shard_placement_fn` over `shards` shards. FSDP2 splits dim 0 and pads it, so a
    parameter with fewer rows than shards (a mixture's 8 experts over 32 shards, whole on each
    rank of a tensor-parallel group) left each of the first 8 ranks a whole expert and the other
    24 as much padding: Mixtral-8x7B under FSDP x TP8 at 256 ranks needed 84.8 GiB a rank of an
    H100's 80. Such a parameter is split on its first dimension with as many rows (torchtitan
    splits experts on dim 1 for the same reason); a tensor-parallel one keeps FSDP2's default,
    as does one that no dimension spreads."""
    from torch.distributed.tensor import DTensor, Shard

    def place(param: nn.Parameter) -> Any:
        if isinstance(param, DTensor) or param.ndim == 0 or param.shape[0] >= shards:
            return None
        return next((Shard(d) for d, rows in enumerate(param.shape) if rows >= shards), None)

    return place


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
