"""`strategy.ep` laid out (issue 65): the experts of a mixture of experts split over `ep` of the
data-parallel ranks, the rest of the model held as DDP or FSDP2 hold it over all of them.

The run's mesh for the experts is (dp_rest, ep) = (W/ep, ep), as torchtitan borrows its `ep`
dimension from the data-parallel ranks: the ranks of an `ep` row hold one model's experts between
them (raylane.loop.distributed.expert_parallel: DTensor Shard(0), tokens dispatched by
all-to-all), and the W/ep ranks of a `dp_rest` column hold the same experts. Both dimensions are
process groups of their own: the all-to-alls never share a group with DDP's gradient buckets.

Gradients (expert_parallel's docstring derives them): an expert's gradient sums every rank's
loss through the backward all-to-all, so it is divided by W, and summed over `dp_rest` first.
- DDP: the experts are kept out of DDP (its all-reduce would average different experts) and each
  expert parameter's gradient gets a hook that does exactly that as it arrives (with gradient
  accumulation, once a micro-batch: linear, so exact, at the cost of an all-reduce over dp_rest
  per micro-batch where dp_rest > 1).
- FSDP2: each experts module is its own FSDP2 unit over `dp_rest` (sharded further there), its
  reduce-scatter dividing by W (`set_gradient_divide_factor`), as torchtitan does; the blocks and
  the root are sharded over all W ranks as without experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raylane.loop.distributed.expert_parallel import apply_expert_parallel, expert_parameter_names
from raylane.loop.distributed.expert_plan import EpPlan, resolve_ep_plan


@dataclass
class Experts:
    """The experts as laid out: their modules' paths and the (dp_rest, ep) mesh."""

    names: list[str]
    mesh: Any
    world_size: int

    @property
    def ep(self) -> int:
        return self.mesh["ep"].size()

    def describe(self, model: nn.Module) -> str:
        """What the strategy line says: `ep2: 4 experts modules, 2 of 4 experts a rank`."""
        total = model.get_submodule(self.names[0]).ep_experts
        return f"ep{self.ep}: {len(self.names)} experts modules, {total // self.ep} of {total} experts a rank"


def lay_out_experts(
    model: nn.Module,
    plan: EpPlan | None,
    ep: int,
    world_size: int,
    device: torch.device,
    capacity_factor: float | None = None,
) -> Experts:
    """Split the experts `plan` names over `ep` ranks (in place; the model may be on the meta
    device), each taking at most its capacity from a rank (`capacity_factor`; None: every pair).
    ValueError, one line, for a plan that names no experts module, or experts that `ep` does not
    divide (raylane.loop.distributed.expert_plan)."""
    from torch.distributed.device_mesh import init_device_mesh

    if plan is None:
        raise ValueError(f"strategy.ep = {ep}: the pipeline gives no ep_plan (which modules are its experts)")
    names = resolve_ep_plan(model, plan, ep=ep)
    mesh = init_device_mesh(device.type, (world_size // ep, ep), mesh_dim_names=("dp_rest", "ep"))
    # One group over both dimensions, which DTensor then reduces over at once (a norm over the
    # experts under FSDP2: gradient clipping) rather than in two all-reduces, one a dimension.
    mesh[("dp_rest", "ep")]._flatten("dp_rest_ep")
    for name in names:  # a model built with weights: rank 0's, as DDP's broadcast would give it
        module = model.get_submodule(name)
        if not any(p.is_meta for p in module.parameters()):
            module.to(device)
            for p in module.parameters():
                dist.broadcast(p.data, src=0)
    apply_expert_parallel(model, names, mesh["ep"], capacity_factor=capacity_factor)
    return Experts(names, mesh, world_size)


def keep_out_of_ddp(model: nn.Module, experts: Experts) -> None:
    """Before DDP wraps `model`: DDP leaves the experts alone, and their gradients are reduced
    by a hook of their own (summed over dp_rest, divided by W)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = expert_parameter_names(model)
    DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    rest = experts.mesh["dp_rest"]
    group = rest.get_group() if rest.size() > 1 else None
    for name in names:
        param = model.get_parameter(name)
        if param.requires_grad:  # frozen experts (LoRA on the attention) have no gradient to reduce
            param.register_hook(_reduced(experts.world_size, group))


def _reduced(world_size: int, group: Any) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if group is None:
            return grad / world_size
        local = (grad.to_local() if isinstance(grad, DTensor) else grad).clone()
        dist.all_reduce(local, group=group)
        local /= world_size
        if isinstance(grad, DTensor):
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return local

    return hook


def shard_experts_fsdp(model: nn.Module, experts: Experts, options: dict[str, Any], reshard: bool) -> None:
    """Each experts module its own FSDP2 unit over dp_rest, before the blocks are sharded (their
    FSDP2 units then leave the experts' parameters to it)."""
    from torch.distributed.fsdp import fully_shard

    opts = {k: v for k, v in options.items() if k not in ("mesh", "shard_placement_fn")}
    for name in experts.names:
        module = fully_shard(
            model.get_submodule(name), mesh=experts.mesh["dp_rest"], reshard_after_forward=reshard, **opts
        )
        module.set_gradient_divide_factor(float(experts.world_size))
        # A sum, then the division: NCCL's pre-multiplied sum, which FSDP2 would use, gloo lacks.
        # Not over one rank (dp_rest 1, no collective): there torch 2.13's FSDP2 divides by the
        # factor twice when forced to sum (its copy in place of the reduce-scatter, then the
        # post-division), halving the experts' gradients at ep = W (seen: AdamW's exp_avg half
        # DDP's); unforced, it divides once.
        if experts.mesh["dp_rest"].size() > 1:
            module.set_force_sum_reduction_for_comms(True)
