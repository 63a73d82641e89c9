"""Expert parallelism (issue 65, its core): each rank of an `ep` mesh holds E/ep of a mixture of
experts' experts, and the tokens the model's own router sent to an expert travel to the rank
that holds it and back, by all-to-all, as torchtitan's token dispatcher does
(torchtitan/models/common/token_dispatcher.py, MOE_SHARDING.md).

What it takes: an experts module (transformers 5's fused experts: Qwen2/3-MoE, Mixtral, OLMoE...;
or a user's own written the torchtitan way) whose parameters all have the number of experts E as
their leading dimension and whose forward is `experts(hidden[T, H], top_k_index[T, k],
top_k_weights[T, k]) -> [T, H]`. The router runs in the model as it is; only this call moves.

- `shard_experts` makes each parameter a DTensor `Shard(0)` on the ep mesh: rank r keeps experts
  [r*E/ep, (r+1)*E/ep), its own copy (not a view: the full tensor can be freed), and
  torch.distributed.checkpoint reads or writes the experts at any other layout. No communication:
  each rank cuts its rows from its own full tensor, so the ranks must hold the same weights (one
  seed, one checkpoint). On the meta device the parameters become meta DTensors of the local
  shape; materialize them with `to_empty` then an init or a DCP load (each rank reads its rows).
- `apply_expert_parallel` shards the named modules and gives each the dispatching forward: sort
  the T*k (token, expert) pairs by expert, swap the per-expert counts (one all-to-all of E
  integers), send each pair's token to its expert's rank (all-to-all with uneven splits), run the
  module's own forward on the local shards (`.to_local()`) with local expert ids, k = 1 and weight
  1, send the results back, and on the origin rank multiply by top_k_weights (the router's
  gradient is the one-process one) and sum over k. No capacity by default: every pair the router
  chose is computed. Memory: a rank sends T*k rows of H and receives what every rank routed to
  its experts, T*k*ep rows at worst (every token of every rank to one rank's experts), twice
  (there and back) plus the local experts' activations on them.
- A capacity (`capacity_factor` c, strategy.ep_capacity_factor): each rank sends each expert at
  most C = ceil(c * T*k / E) of its own T*k pairs a forward (per origin rank, as Switch and
  GShard cap each device's group of tokens: decided where the tokens are, with no exchange), its
  first C in the batch's order; the rest are dropped: their output is 0 (the residual carries the
  token on, as Switch's does) and their weight has no gradient. A rank then receives at most
  E/ep * ep * C = c*T*k rows (equal T), not T*k*ep. Counted in `expert_drops`. One process's
  capacity over the same tokens is not the same cap: it caps all ranks' tokens together.
- `expert_load` reads the pairs each rank routed to each global expert since the last reset (a
  device tensor summed in every training forward, dropped pairs included; evaluation's are not
  counted: no host sync, no collective). Summed over the ep ranks it is one process's count for
  the same tokens. `dispatch_seconds`: the time spent in the all-to-alls, on CPU.

Gradients. An expert's gradient on its rank sums what every rank's loss sends back through the
all-to-all's backward. With each rank's loss a mean over its own tokens and the dense gradients
averaged over the W data-parallel ranks (DDP, FSDP), one process's gradient of the mean over all
ranks' tokens is the expert gradient summed over every rank's loss divided by W. So:
- ep == W (every rank a different shard): divide the expert gradients by W after backward,
  `reduce_expert_grads(model, W)`; nothing to all-reduce. Under DDP, keep the experts out of it
  (as below). Tested: tests/e2e/test_expert_parallel.py.
- DDP with ep < W (not yet tested here): keep the experts out of DDP (its all-reduce would mix different experts):
  `DDP._set_params_and_buffers_to_ignore_for_model(model, expert_parameter_names(model))` before
  wrapping; after backward, `reduce_expert_grads(model, W, group)` with `group` the W/ep ranks that
  hold the same shard (the "dp mod ep" ranks: the other dimension of a (W/ep, ep) mesh): it sums
  over them and divides by W.
- FSDP2 (not yet tested here): `fully_shard(experts, mesh=<the dp-mod-ep mesh>)`, built from the
  same root mesh as the ep mesh, after `apply_expert_parallel`; then
  `experts.set_gradient_divide_factor(W)`: FSDP's reduce-scatter sums over the W/ep ranks and
  divides by W, as torchtitan does. The dense part is FSDP's as without ep.
- Gradient accumulation over N micro-batches with a loss divided by N: the same, unchanged.

The collectives: two all-to-alls of rows and one of counts per experts module per forward, two
in backward, in the graph's order on every rank alike. A 1-D mesh over the whole world is torch's
default group, which DDP reduces over too; its bucket all-reduces, fired by the dense part's
gradients (the same graph on every rank), then interleave with the backward all-to-alls in one
order on every rank (tested under gloo). An ep group of its own (a dimension of a 2-D mesh, or
a new group over the same ranks) is the safer choice under NCCL, where two orders would hang.
Under no_grad (evaluation) nothing runs backward; a rank must still call every forward the
others call (an experts module with no token on a rank still takes part).

A transformers-4 style `ModuleList` of experts is not supported: the block's own loop calls
`experts[i](x)` expert by expert, so there is no single call to dispatch; it needs the block's
forward (or a fused module in its place) first.

What a module's forward may do: read its parameters and `num_experts` through `self` (they are
swapped for the local shards and E/ep), call its submodules and its own methods. It may not
call zero-argument `super()` or set attributes on `self`: it runs on a view of the module.
Activation recompute runs the forward again (its collectives on every rank alike) and counts its
tokens twice in `expert_load`."""

from __future__ import annotations

import inspect
import math
import time
import types
from fnmatch import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def match_modules(model: nn.Module, patterns: list[str]) -> list[str]:
    """The paths of `model`'s modules that `patterns` name (`*` standing for one name in a path,
    `model.layers.*.mlp.experts`), in the model's order; ValueError naming the first pattern that
    names none (a misspelt path would otherwise leave every expert on every rank, silently)."""
    paths = [name for name, _ in model.named_modules() if name]
    found: set[str] = set()
    for pattern in patterns:
        atoms = pattern.split(".")
        hits = {p for p in paths if len(parts := p.split(".")) == len(atoms) and all(map(fnmatch, parts, atoms))}
        if not hits:
            raise ValueError(f"expert parallelism: {pattern!r} names no module of {type(model).__name__}")
        found |= hits
    return [p for p in paths if p in found]


def expert_count(experts: nn.Module, ep: int, name: str = "experts") -> int:
    """E, the number of experts, read off the module's own parameters (each must lead with it,
    and none may sit in a submodule); ValueError naming the module and the numbers otherwise, and
    where `ep` does not divide E."""
    own = dict(experts.named_parameters(recurse=False))
    if nested := sorted(set(dict(experts.named_parameters())) - set(own)):
        raise ValueError(
            f"expert parallelism: {name}.{nested[0]} is a submodule's: only the module's own can be sharded"
        )
    if not own:
        raise ValueError(f"expert parallelism: {name} ({type(experts).__name__}) has no parameters to shard")
    count = getattr(experts, "num_experts", None)
    count = count if isinstance(count, int) else next(iter(own.values())).shape[0]
    for pname, p in own.items():
        if p.dim() == 0 or p.shape[0] != count:
            shape = tuple(p.shape)
            raise ValueError(
                f"expert parallelism: {name}.{pname} has shape {shape}, not the number of experts ({count}) leading"
            )
    if count % ep:
        raise ValueError(f"expert parallelism: {name} has {count} experts, which ep {ep} does not divide")
    return count


def shard_experts(experts: nn.Module, ep_mesh: Any, *, name: str = "experts") -> None:
    """Each parameter of `experts` made a DTensor `Shard(0)` on `ep_mesh` (a 1-D DeviceMesh): this
    rank keeps only its E/ep experts (a copy, so the full tensor can be freed); requires_grad kept.
    Works on the meta device. ValueError (`expert_count`) before anything changes."""
    from torch.distributed.tensor import DTensor, Shard

    count = expert_count(experts, ep_mesh.size(), name)
    local, rank = count // ep_mesh.size(), ep_mesh.get_local_rank()
    for pname, p in list(experts.named_parameters(recurse=False)):
        if isinstance(p, DTensor):
            raise ValueError(f"expert parallelism: {name}.{pname} is already distributed ({p.placements})")
        mine = p.detach()[rank * local : (rank + 1) * local].clone()
        shard = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
        experts.register_parameter(pname, nn.Parameter(shard, requires_grad=p.requires_grad))


def apply_expert_parallel(
    model: nn.Module, names: list[str], ep_mesh: Any, *, capacity_factor: float | None = None
) -> list[str]:
    """Shards each experts module `names` names (`match_modules`) over `ep_mesh` and gives it the
    dispatching forward (module docstring), with a capacity of `capacity_factor` (None: none);
    returns their paths. Every module is checked before any changes (ValueError naming it).
    Parameter names and the state dict's keys stay the same."""
    paths = match_modules(model, names)
    modules = {path: model.get_submodule(path) for path in paths}
    for path, module in modules.items():
        if isinstance(module, ExpertParallel):
            raise ValueError(f"expert parallelism: {path} is already expert-parallel")
        expert_count(module, ep_mesh.size(), path)
    for path, module in modules.items():
        count = expert_count(module, ep_mesh.size(), path)
        shard_experts(module, ep_mesh, name=path)
        module.__class__ = _parallel_class(type(module))
        module.ep_mesh = ep_mesh
        module.ep_experts = count
        module.ep_capacity_factor = capacity_factor
        device = next(module.parameters()).device
        device = torch.device("cpu") if device.type == "meta" else device
        module.ep_tokens = torch.zeros(count, dtype=torch.long, device=device)
        module.ep_dropped = torch.zeros((), dtype=torch.long, device=device)
    return paths


def expert_parallel_modules(model: nn.Module) -> dict[str, ExpertParallel]:
    return {name: m for name, m in model.named_modules() if isinstance(m, ExpertParallel)}


def expert_load(model: nn.Module, *, reset: bool = False) -> dict[str, torch.Tensor]:
    """{experts module path: the (token, expert) pairs this rank routed to each of its E global
    experts since the last reset}, int64 tensors on the model's device (no host sync until read).
    `reset` zeroes the counters after reading them (a window's counts)."""
    return _counters(model, "ep_tokens", reset)


def expert_drops(model: nn.Module, *, reset: bool = False) -> dict[str, torch.Tensor]:
    """{experts module path: the pairs this rank's capacity dropped since the last reset}, int64
    tensors of one number on the model's device (0 without a capacity)."""
    return _counters(model, "ep_dropped", reset)


def _counters(model: nn.Module, name: str, reset: bool) -> dict[str, torch.Tensor]:
    out = {}
    for path, m in expert_parallel_modules(model).items():
        out[path] = getattr(m, name).clone()
        if reset:
            getattr(m, name).zero_()
    return out


_dispatch_s = [0.0, 0]  # seconds in the dispatch's all-to-alls on CPU, and the calls timed


def dispatch_seconds(*, reset: bool = False) -> float | None:
    """This process's seconds in the dispatch's all-to-alls (counts and rows, forward and
    backward, every experts module) since the last reset, waiting for the other ranks included;
    None when none was timed. Timed on CPU only: gloo's collectives return when done, so the
    host's clock around them is their time. On a GPU the call returns once queued: its time
    would need a device sync or CUDA events per call, so it is not measured here."""
    seconds = _dispatch_s[0] if _dispatch_s[1] else None
    if reset:
        _dispatch_s[:] = [0.0, 0]
    return seconds


def _all_to_all(out: torch.Tensor, rows: torch.Tensor, out_splits: Any, in_splits: Any, group: Any) -> None:
    """dist.all_to_all_single, timed where the host's clock is its time (`dispatch_seconds`)."""
    if out.device.type != "cpu":
        dist.all_to_all_single(out, rows, out_splits, in_splits, group=group)
        return
    start = time.perf_counter()
    dist.all_to_all_single(out, rows, out_splits, in_splits, group=group)
    _dispatch_s[0] += time.perf_counter() - start
    _dispatch_s[1] += 1


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The names (as `model.named_parameters()` gives them) of the expert-parallel modules'
    parameters: what DDP must ignore (`DDP._set_params_and_buffers_to_ignore_for_model`)."""
    return [
        f"{name}.{pname}"
        for name, m in expert_parallel_modules(model).items()
        for pname, _ in m.named_parameters(recurse=False)
    ]


def _expert_grads(model: nn.Module) -> list[torch.Tensor]:
    """The local shards of the expert parameters' gradients (views: writing them writes the grads)."""
    grads = []
    for m in expert_parallel_modules(model).values():
        for p in m.parameters(recurse=False):
            if p.grad is not None:
                grads.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    return grads


def scale_expert_grads(model: nn.Module, factor: float) -> None:
    """Multiplies every expert parameter's gradient by `factor`, in place."""
    for g in _expert_grads(model):
        g.mul_(factor)


def reduce_expert_grads(model: nn.Module, data_parallel: int, group: Any = None) -> None:
    """The expert gradients made one process's (module docstring): summed over `group` (the
    ranks that hold the same experts; None when ep is the whole data-parallel world), in one
    all-reduce of them all, then divided by `data_parallel`, the number of data-parallel ranks
    whose mean loss the dense gradients average."""
    grads = _expert_grads(model)
    if grads and group is not None and dist.get_world_size(group) > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))
    for g in grads:
        g.div_(data_parallel)


# -- the dispatch ----------------------------------------------------------------------------------


def sort_pairs(top_k_index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the T*k flattened (token, expert) pairs' order sorted by expert, stable; the pairs per
    expert [E]): pair i is token i // k's choice i % k. No host sync."""
    ids = top_k_index.reshape(-1)
    counts = torch.zeros(experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    return torch.argsort(ids, stable=True), counts


def arrived_expert_ids(arrived_counts: torch.Tensor, ep: int, total: int) -> torch.Tensor:
    """The local expert id of each row received: `arrived_counts` [ep * E/ep] holds, source rank by
    source rank, how many rows each local expert gets from it, and the rows arrive in that order."""
    local = arrived_counts.numel() // ep
    ids = torch.arange(local, device=arrived_counts.device).repeat(ep)
    return ids.repeat_interleave(arrived_counts, output_size=total)


def capacity_of(factor: float | None, pairs: int, experts: int) -> int | None:
    """The pairs each expert takes from one rank's `pairs` (T*k) a forward: ceil(factor * T*k / E)."""
    return None if factor is None else math.ceil(factor * pairs / experts)


def keep_within(
    top_k_index: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`order` (the pairs sorted by expert) with each expert's first `capacity` pairs first, still
    by expert, and the dropped after them; the pairs kept per expert). No host sync."""
    ids = top_k_index.reshape(-1)[order]
    starts = torch.cumsum(counts, 0) - counts
    dropped = torch.arange(ids.numel(), device=ids.device) - starts[ids] >= capacity
    return order[torch.argsort(dropped.to(torch.uint8), stable=True)], counts.clamp(max=capacity)


def unsort(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """`rows` (in `order`) put back in the pairs' own order: unsort(x[order], order) == x."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return rows[inverse]


class AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits whose backward sends the gradients back the way the
    rows came (torch.distributed.nn.functional's is deprecated in torch 2.13 for a functional
    collective that needs its own wait)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        _all_to_all(out, rows.contiguous(), receive, send, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        _all_to_all(back, grad.contiguous(), ctx.send, ctx.receive, ctx.group)
        return back, None, None, None


class LocalView:
    """An experts module as its original forward sees it on this rank: its parameters the local
    shards and `num_experts` E/ep; its own methods bound to the view (they see the shards too),
    everything else (submodules, config, flags) the module's."""

    __slots__ = ("_module", "_local")

    def __init__(self, module: nn.Module, local: dict[str, Any]) -> None:
        self._module, self._local = module, local

    def __getattr__(self, name: str) -> Any:
        if name in self._local:
            return self._local[name]
        method = inspect.getattr_static(type(self._module), name, None)
        if isinstance(method, types.FunctionType):  # a plain method: not a static or class method, nor a property
            return types.MethodType(method, self)
        return getattr(self._module, name)


class ExpertParallel(nn.Module):
    """Mixed into an experts module's class by apply_expert_parallel (as FSDP2 swaps a module's
    class): its forward dispatches, and runs the class's own forward on the local experts."""

    ep_mesh: Any
    ep_experts: int
    ep_tokens: torch.Tensor
    ep_capacity_factor: float | None
    ep_dropped: torch.Tensor
    ep_original_forward: Any

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()
        tokens, k = top_k_index.shape
        order, counts = sort_pairs(top_k_index, self.ep_experts)
        kept, capacity = counts, capacity_of(self.ep_capacity_factor, tokens * k, self.ep_experts)
        if capacity is not None:
            order, kept = keep_within(top_k_index, order, counts, capacity)
        if self.training:
            with torch.no_grad():
                self.ep_tokens = self.ep_tokens.to(counts.device)
                self.ep_tokens += counts
                self.ep_dropped = self.ep_dropped.to(counts.device)
                self.ep_dropped += (counts - kept).sum()
        arrived_counts = torch.empty_like(kept)
        _all_to_all(arrived_counts, kept, None, None, group)
        # The one host sync: all_to_all_single takes its splits as Python ints.
        send, receive = torch.stack([kept.view(ep, -1).sum(1), arrived_counts.view(ep, -1).sum(1)]).tolist()
        sent = order[: sum(send)]  # every pair, or those within the capacity
        arrived = AllToAll.apply(hidden_states[sent // k], send, receive, group)
        out = self.run_local(arrived, arrived_expert_ids(arrived_counts, ep, sum(receive)))
        back = AllToAll.apply(out, receive, send, group)
        if len(sent) < tokens * k:  # a dropped pair's output is 0
            pairs = back.new_zeros((tokens * k, *back.shape[1:])).index_copy(0, sent, back)
        else:
            pairs = unsort(back, order)
        pairs = pairs.view(tokens, k, -1)
        return (pairs * top_k_weights.unsqueeze(-1)).sum(1).to(hidden_states.dtype)

    def run_local(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The module's own math on this rank's experts: each row to its one expert, weight 1.
        The rows and every local shard join the result's graph (a zero-size slice's sum, 0):
        transformers' eager loop leaves out what no row reaches, and a rank whose experts got no
        row would then skip the backward all-to-alls the other ranks wait in (seen: a hang), and
        give its experts no gradient where one process gives them zero (AdamW still steps those)."""
        shards = {n: p.to_local() for n, p in self.named_parameters(recurse=False)}
        view = LocalView(self, {**shards, "num_experts": self.ep_experts // self.ep_mesh.size()})
        weight = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        out = type(self).ep_original_forward(view, rows, local_ids.unsqueeze(1), weight)
        joined = [t.reshape(-1)[:0].sum() for t in (rows, *shards.values()) if t.requires_grad]
        return out + torch.stack(joined).sum().to(out.dtype) if joined else out


_CLASSES: dict[type[nn.Module], type] = {}


def _parallel_class(cls: type[nn.Module]) -> type:
    """`cls` with ExpertParallel's forward in front (one class made per experts class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {"ep_original_forward": cls.forward}
        )
    return _CLASSES[cls]
