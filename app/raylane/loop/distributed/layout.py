"""A run's layout over its ranks, named as the summary, the terminal's strategy line and MLflow's
tags show it (`fsdp×tp2`, `hsdp×tp2×pp2`), and what `strategy.tp: auto` chooses it from: each
candidate's per-rank bytes, measured by laying a meta copy of the model out for real on fake
process groups (no memory, no communication), and the activations estimated. That work, and
raylane.loop.distributed.forward_checks', runs inside `fake_work`, which leaves the process as it found it
for the run it goes on to train.

The mesh's dimensions are torchtitan's, outermost first: pp, dp_replicate, dp_shard, cp, tp."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

log = logging.getLogger("raylane")

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """How many ranks each mesh dimension spans, and how the data-parallel ranks hold the model
    (`name`: ddp, fsdp or hsdp; single for one rank)."""

    name: str
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False

    @classmethod
    def of(cls, strategy: Any) -> Layout:
        """A raylane.loop.distributed.fsdp.Strategy's: a model-parallel run's one mesh read by dimension
        (FSDP2 with replicas named hsdp), else its data-parallel ranks as replicas under DDP,
        shards under FSDP, both under HSDP."""
        mesh: tuple[int, ...] = tuple(strategy.mesh_shape) or (1,)
        name = strategy.name
        if len(mesh) == len(MESH_DIMS):
            pp, replicate, shard, cp, tp = mesh
            name = "hsdp" if name == "fsdp" and replicate > 1 else name
        else:
            pp, cp, tp = 1, 1, 1
            replicate, shard = {"ddp": (mesh[0], 1), "hsdp": (mesh[0], mesh[-1])}.get(name, (1, mesh[-1]))
        return cls(
            name,
            pp=pp,
            dp_replicate=replicate,
            dp_shard=shard,
            cp=cp,
            tp=tp,
            sequence_parallel=strategy.sequence_parallel,
            loss_parallel=strategy.loss_parallel,
        )

    @property
    def data_parallel(self) -> int:
        return self.dp_replicate * self.dp_shard

    def label(self) -> str:
        """`fsdp×tp2+sp`, `ddp×tp2`, `hsdp×tp2×pp2`: the data-parallel flavour where more than one
        rank holds a share of the batch (`tp2` where one group is the whole world), then each
        model-parallel dimension over more than one rank (`+sp`, `+lp`: sequence, loss parallel)."""
        parts = [self.name] if self.data_parallel > 1 else []
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + "+sp" * self.sequence_parallel + "+lp" * self.loss_parallel)
        parts += [f"{dim}{n}" for dim, n in (("cp", self.cp), ("pp", self.pp)) if n > 1]
        return "×".join(parts) or self.name

    def mesh_text(self) -> str:
        """The mesh's dimensions beyond data parallelism's, `dp_shard 2, tp 2` (the data-parallel
        ones always, the others where they span more than one rank); "" without any."""
        if self.tp == self.cp == self.pp == 1:
            return ""
        dims = [(d, getattr(self, d)) for d in MESH_DIMS]
        return ", ".join(f"{d} {n}" for d, n in dims if n > 1 or d in ("dp_shard", "tp"))


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


def fake_mesh(mesh_shape: tuple[int, int]) -> Any:
    """A (dp_shard, tp) mesh over this process's world on torch's `fake` backend (shapes only;
    nothing is sent). Collective (the groups are made by every rank)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the fake backend
    from torch.distributed.device_mesh import init_device_mesh

    names = ("dp_shard", "tp")
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=names, backend_override=dict.fromkeys(names, "fake"))


def parameter_bytes(
    model: nn.Module, blocks: Any, mesh_shape: tuple[int, int], plan: Any, *, sequence_parallel: bool, mesh: Any = None
) -> int:
    """The bytes of parameters one rank holds under FSDP2 over `mesh_shape` = (dp_shard, tp), the
    pipeline's `plan` applied when tp > 1: measured, not computed, by laying out a meta copy of the
    model on process groups of torch's `fake` backend (`fake_mesh`, or `mesh`: one made so) over
    this process's world, whose size the mesh must have: the default process group's (a real one
    on the ranks, or a fake one in a test). Rank 0's share, the largest where shards are uneven.
    Collective (the groups are made by every rank)."""
    from torch.distributed.fsdp import fully_shard

    from raylane.loop.distributed.tensor_parallel import apply_plan

    meta, blocks = meta_copy(model, blocks)
    with fake_work():
        mesh = mesh if mesh is not None else fake_mesh(mesh_shape)
        if mesh_shape[1] > 1:
            apply_plan(meta, plan, mesh["tp"], sequence_parallel=sequence_parallel)
        for block in blocks:
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(meta, mesh=mesh["dp_shard"])
        total = 0
        for p in meta.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total


def tp_candidates(cfg: Any, world_size: int, node_ranks: int) -> list[int]:
    """The tensor-parallel degrees `strategy.tp: auto` may choose, smallest first: above 1,
    dividing the ranks of a node (a group's collectives stay on its links) and the world, and
    allowed by the config's own checks at that degree (a model's heads, vocabulary, block size).
    None when the config does not pass its checks here at tp 1 either (an input path this host
    cannot see): nothing would tell an allowed degree from another."""
    found = []
    for tp in range(1, node_ranks + 1):
        if node_ranks % tp or world_size % tp:
            continue
        as_fixed = cfg.model_dump()
        as_fixed["strategy"] |= {"tp": tp, "name": "fsdp"}
        if tp == 1:  # what needs tp > 1 is off there
            as_fixed["strategy"] |= {"sequence_parallel": False, "loss_parallel": False}
        try:
            type(cfg).model_validate(as_fixed)
        except ValueError as exc:
            if tp == 1:
                log.warning("strategy.tp: auto tries no tensor parallelism: the config's checks fail here (%s)", exc)
                return []
            continue
        found.append(tp)
    return found[1:]


@dataclass
class Candidate:
    """One layout `strategy.tp: auto` weighs: its name in the estimate, its data-parallel flavour,
    tp, and the bytes one rank would hold."""

    key: str
    name: str
    tp: int
    bytes: int


def weigh(
    cfg: Any,
    world_size: int,
    model: nn.Module,
    blocks: Any,
    plan: Any,
    estimate: dict[str, int],
    per_byte: int,
    device: tuple[int, float],
    activations: Callable[[Callable[[nn.Module], None]], int] | None = None,
) -> tuple[Candidate, dict[str, int], str]:
    """(the layout chosen, every candidate's bytes per rank, the reason), for `strategy.tp: auto`:
    the simplest whose bytes fit the device's (bytes, usable share): DDP (with `strategy.name:
    auto`), FSDP, then FSDP x TP by growing tp (`tp_candidates`, with a plan); else the one that
    needs least. FSDP's and TP's parameter bytes are measured (`parameter_bytes`) and taken
    `per_byte` times (parameters, gradients, optimizer state); plus two gathered blocks, divided
    by tp; plus the activations: the estimate's meta forward's, and for a TP candidate
    `activations(lay_out)`'s, one rank's measured on a meta copy with the plan laid out
    (sequence parallelism as the config says): what the layout saves, and nothing it does not.
    Where that cannot be measured (no example, a forward the plan breaks), the whole model's.
    Collective."""
    from raylane.loop.distributed.blocks import blocks_of
    from raylane.loop.distributed.devices import local_world_size, size_text

    s = cfg.strategy
    acts = estimate["activations"]
    largest = max(
        (sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks_of(model, blocks)), default=0
    )
    tps = tp_candidates(cfg, world_size, local_world_size(default=world_size)) if plan is not None else []
    if tps:  # the degrees that split every attention's heads whole (raylane.loop.distributed.heads)
        from raylane.loop.distributed.heads import heads_problem
        from raylane.loop.distributed.tensor_parallel import plan_for

        rules = plan_for(model, plan, sequence_parallel=s.sequence_parallel)
        tps = [tp for tp in tps if heads_problem(model, rules, tp) is None]
    options = [Candidate("ddp", "ddp", 1, estimate["ddp"])] if s.name == "auto" else []
    measured: dict[str, int] = {}
    with fake_work():  # in the process that trains next: see fake_work
        for tp in [1, *tps]:
            mesh = fake_mesh((world_size // tp, tp))
            held = parameter_bytes(
                model, blocks, (world_size // tp, tp), plan, sequence_parallel=s.sequence_parallel, mesh=mesh
            )
            mine = acts
            if tp > 1 and activations is not None:
                mine = measured[f"activations_tp{tp}"] = _rank_activations(activations, plan, mesh, s, acts)
            need = held * per_byte + mine + 2 * largest // tp
            options.append(Candidate("fsdp" if tp == 1 else f"fsdp_tp{tp}", "fsdp", tp, need))
    budget, share = device
    chosen = next((c for c in options if c.bytes <= share * budget), None)
    needs = ", ".join(f"{c.key.replace('_', '×').upper()} ~{size_text(c.bytes)}" for c in options)
    why = f"tp auto: per rank {needs}, of {size_text(budget)} per device ({share:.0%} usable)"
    if chosen is None:
        chosen, why = min(options, key=lambda c: c.bytes), f"{why}; none fits: the smallest"
    return chosen, {"activations": acts, **measured, "device": budget, **{c.key: c.bytes for c in options}}, why


def _rank_activations(activations: Callable, plan: Any, mesh: Any, s: Any, whole: int) -> int:
    """One rank's activations with the plan laid out over `mesh`'s tp ranks; `whole` where the
    forward does not run so (said at debug level: the run itself will say why)."""
    from raylane.loop.distributed.tensor_parallel import apply_plan

    def lay_out(meta: nn.Module) -> None:
        # the head's logits gathered: the estimate's loss runs outside loss_parallel's context,
        # so loss parallelism's split logits are not counted as saved (never a saving not measured)
        apply_plan(meta, plan, mesh["tp"], sequence_parallel=s.sequence_parallel)

    try:
        return activations(lay_out)
    except Exception as exc:  # noqa: BLE001 - a forward the plan breaks: nothing saved is counted
        log.debug("tp auto: activations under tp %d not measured (%s: %s)", mesh["tp"].size(), type(exc).__name__, exc)
        return whole
