"""The model-parallel layout: the (pp, dp_replicate, dp_shard, cp, tp) mesh of a run's ranks
(`model_parallel_strategy`, `device_mesh`, `fsdp_mesh`), a model laid out over it with tensor
parallelism (`lay_out_tensor_parallel`) or as this rank's pipeline stages
(`lay_out_pipeline_parallel`). raylane.loop.distributed.parallelize.parallelize calls it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from raylane.config import BaseConfig
from raylane.loop.distributed.blocks import Blocks
from raylane.loop.distributed.fsdp import Strategy, fully_shard, on_meta, prepare_blocks
from raylane.loop.distributed.layout import MESH_DIMS
from raylane.loop.distributed.tensor_parallel import apply_plan, apply_rules, gather_when_evaluating, plan_for


def model_parallel_strategy(cfg: BaseConfig, world_size: int, tp: int | None = None, why: str = "") -> Strategy:
    """The (pp, dp_replicate, dp_shard, cp, tp) layout of `world_size` ranks (dp_shard: the rest);
    `tp`: the degree `tp: auto` chose, with `why`."""
    s = cfg.strategy
    tp, pp, replicate, cp = tp or s.tp_degree, s.pp, s.dp_replicate, s.cp
    if world_size % (tp * pp * replicate * cp):  # checked before launch (raylane.layout_checks.check_layout)
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


def lay_out_pipeline_parallel(
    model: nn.Module, found: Blocks, cfg: BaseConfig, device: torch.device, strategy: Strategy, plan, stages, loss_fn
) -> nn.Module:
    """This rank's pipeline stages, each in issue 49's order: the split (on the model as built, on
    the meta device or not), the TP plan and its ties, recompute and compile, FSDP2 (over one rank
    too: every parameter a DTensor, so a checkpoint is sharded by stage), then storage."""
    from raylane.loop.distributed.pipeline_parallel import pipeline_model, stage_plan

    mesh = device_mesh(device, strategy.mesh_shape)
    rules = plan_for(model, plan, sequence_parallel=strategy.sequence_parallel) if strategy.tp > 1 else None

    def prepare(stage: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        if rules is not None:  # the plan's rules for the modules this stage holds
            apply_rules(stage, stage_plan(stage, rules), mesh["tp"])
        prepare_blocks(stage, cfg, blocks)
        return fully_shard(stage, blocks, cfg, device, strategy, fsdp_mesh(mesh))

    return pipeline_model(model, found, cfg.strategy, device, mesh["pp"], prepare, stages, loss_fn)
