"""Work on torch's `fake` process groups and the meta device, in a process that may train next:
`strategy.tp: auto`'s measurement (raylane.loop.distributed.auto) and the forward checks before
launch (raylane.loop.distributed.forward_checks) lay a meta copy of the model out for real on
fake groups (no memory, no communication) inside `fake_work`, which leaves the process as it found
it for the run it goes on to train."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from torch import nn

from raylane.loop.distributed.layout import Layout


def meta_copy(model: nn.Module, blocks: Any = None) -> tuple[nn.Module, list[nn.Module]]:
    """(a copy of `model` on the meta device, the copy's blocks: raylane.loop.distributed.blocks' of `blocks`),
    its parameters made on the meta device and never copied (ties kept: one memo entry each), so
    that a large model built with its weights costs no second copy of them."""
    from raylane.loop.distributed.blocks import blocks_of

    memo: dict[int, Any] = {id(p): nn.Parameter(p.to("meta"), p.requires_grad) for p in model.parameters()}
    meta, found = copy.deepcopy((model, blocks_of(model, blocks)), memo)  # one copy: the blocks are the copy's
    return meta.to("meta"), found


@contextlib.contextmanager
def fake_work() -> Iterator[None]:
    """Inside: a check or a measurement on torch's `fake` backend (meshes, a plan laid out, a
    forward of DTensors on the meta device); after it, the process as it was for the run it may
    train next: DTensor's sharding caches emptied before and after (`forget_shardings`: why),
    DTensor's RNG tracker as it was (a random op on a mesh makes one, which then draws every
    DTensor's random numbers), and the fake process groups made inside destroyed (nothing of the
    check stays registered beside the run's own groups)."""
    import torch.distributed as dist
    from torch.distributed.tensor import _random

    tracker = _random._rng_tracker
    before = _groups()
    forget_shardings()
    try:
        yield
    finally:
        forget_shardings()
        _random._rng_tracker = tracker
        for group in _groups() - before:
            if dist.get_backend(group) == "fake":  # a mesh over the whole world may hold the real default group
                dist.destroy_process_group(group)


def forget_shardings() -> None:
    """DTensor's sharding-propagation and redistribution caches emptied, in this thread (torch's
    C++ dispatch keeps one per thread) and the process. Why: they key an op by its meshes' shape,
    ranks, dimension names and thread, not by their process groups, and keep the first call's
    mesh in what they hand back; a run's mesh of the same shape then ran on a check's or a
    measurement's fake mesh. Seen: `tp: auto` choosing tp2 trained gpt-tiny on the fake groups
    (nothing sent; loss 5.517 against explicit tp2's 5.499 at step 1), the forward check on
    torchrun's rank 1 made it compute as the fake group's rank 0 (tp2+sp+lp up to 1.5e-3 off from step
    2), and a later measurement in the same process found a destroyed group's name ('Could not
    resolve the process group registered under the name 30') and fell back to the whole model's
    activations. Emptied before the fake work too, so that it never runs on a real mesh's entry.
    Each cache is looked up, not assumed: torch's private names move between releases."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute as redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    clears = [
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # the C++ dispatch's (torch 2.10+)
        getattr(propagator.propagate_op_sharding, "cache_clear", None),
        getattr(getattr(propagator, "_propagate_tensor_meta_cached", None), "cache_clear", None),
        getattr(getattr(redistribute, "_gen_transform_infos", None), "cache_clear", None),
        getattr(redistribute, "clear_redistribute_planner_cache", None),  # planners hold their mesh
    ]
    for clear in clears:
        if clear is not None:
            clear()


def _groups() -> set[Any]:
    """The process groups this process has made (none without a default group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return set()
    return set(dist.distributed_c10d._world.pg_map)


def fake_mesh(layout: Layout) -> Any:
    """A (dp_shard, tp) mesh of `layout`'s data-parallel ranks (as shards) and tensor-parallel
    ranks over this process's world, on torch's `fake` backend (shapes only; nothing is sent).
    Collective (the groups are made by every rank)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the fake backend
    from torch.distributed.device_mesh import init_device_mesh

    names = ("dp_shard", "tp")
    shape = (layout.data_parallel, layout.tp)
    return init_device_mesh("cpu", shape, mesh_dim_names=names, backend_override=dict.fromkeys(names, "fake"))
