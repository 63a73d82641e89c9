"""Where a rehearsal lays a run out (`raylane check CONFIG --world N --nodes M --gpu MODEL`): N
ranks on M nodes of one GPU model from raylane's table (raylane.loop.distributed.devices: memory
and peak FLOP/s), and what of a layout only that size shows: which mesh dimension's groups cross
nodes, and a tensor-parallel group that would (refused: its collectives run several times per
layer). Nothing here builds a model or starts a process group."""

from __future__ import annotations

from dataclasses import dataclass

from raylane.errors import ConfigError
from raylane.loop.distributed.devices import GIB, MEMORY_GIB, named_gpu, table_peak_flops
from raylane.loop.distributed.layout import MESH_DIMS, Layout

# What a rehearsal assumes of a step it cannot time: the share of the GPUs' peak FLOP/s it reaches
# (model FLOPs utilisation). 40% is what torchtitan and Meta's Llama 3 report for dense models in
# bf16 on H100s (38-43%); a run's own `train/mfu` says what it reaches.
MFU = 0.40


@dataclass(frozen=True)
class Target:
    """N ranks (`world`) on `nodes` nodes of `gpu` (a MEMORY_GIB name)."""

    world: int
    nodes: int
    gpu: str

    @property
    def per_node(self) -> int:
        return self.world // self.nodes

    @property
    def memory_bytes(self) -> int:
        return int(MEMORY_GIB[self.gpu] * GIB)

    def peak_flops(self, precision: str) -> float | None:
        return table_peak_flops(self.gpu, precision)

    def flags(self) -> str:
        return f"--world {self.world} --nodes {self.nodes}"

    def text(self) -> str:
        nodes = f"{self.nodes} node{'s' if self.nodes > 1 else ''}"
        return f"{self.world} ranks on {nodes} of {self.per_node} {self.gpu}"


def target_of(world: int, nodes: int, gpu: str | None, accelerator_type: str | None = None) -> Target:
    """The target as the user gave it; ConfigError, one line naming the flag, for a world or node
    count below 1, nodes that do not divide the world, or a GPU the table does not know. `gpu`
    None: the config's scaling.accelerator_type where the table knows it, else an H100."""
    if world < 1:
        raise ConfigError(f"--world = {world}: at least 1 rank")
    if nodes < 1:
        raise ConfigError(f"--nodes = {nodes}: at least 1 node")
    if world % nodes:
        raise ConfigError(
            f"--nodes = {nodes}: does not divide --world {world} (every node runs the same number of ranks)"
        )
    name = named_gpu(gpu) if gpu else named_gpu(accelerator_type or "") or "H100"
    if name is None:
        known = ", ".join(sorted(MEMORY_GIB))
        raise ConfigError(f"--gpu = {gpu!r}: not a GPU raylane's table knows ({known})")
    return Target(world, nodes, name)


def mesh_dims(layout: Layout) -> list[tuple[str, int, int]]:
    """(dimension, ranks, stride) of each mesh dimension over more than one rank, outermost first,
    as torchtitan orders them (tp innermost: its ranks are neighbours, on one node)."""
    dims, stride = [], 1
    for dim in reversed(MESH_DIMS):
        size = getattr(layout, dim)
        if size > 1:
            dims.append((dim, size, stride))
        stride *= size
    return dims[::-1]


def nodes_spanned(size: int, stride: int, per_node: int) -> int:
    """The nodes one group of a mesh dimension (rank 0's: every group alike) spreads over."""
    return len({(k * stride) // per_node for k in range(size)})


def mesh_line(layout: Layout, target: Target) -> str:
    """`tp 8 within a node; dp_shard 32 across 32 nodes`: each dimension's group, where it runs."""
    parts = []
    for dim, size, stride in mesh_dims(layout):
        spans = nodes_spanned(size, stride, target.per_node)
        parts.append(f"{dim} {size} " + ("within a node" if spans == 1 else f"across {spans} nodes"))
    return "; ".join(parts) or "one rank"


def check_nodes(layout: Layout, target: Target) -> None:
    """ConfigError where a tensor-parallel group would span nodes: more ranks than a node has, or
    a count that does not divide a node's ranks (groups straddle two). Its collectives run
    several times in every layer's forward and backward: over the network, the step waits on them
    (torchtitan and Megatron keep tp within a node; raylane's `tp: auto` does)."""
    tp, per_node = layout.tp, target.per_node
    if tp > 1 and (tp > per_node or per_node % tp):
        spans = nodes_spanned(tp, 1, per_node) if tp > per_node else 2
        raise ConfigError(
            f"strategy.tp = {tp}: a tensor-parallel group would span {spans} nodes at {target.flags()} "
            f"({per_node} ranks per node), its collectives in every layer over the network; give strategy.tp a "
            f"divisor of {per_node}"
        )
