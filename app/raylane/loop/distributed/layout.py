"""A run's layout over its ranks, one type (`Layout`, after torchtitan's `ParallelDims`): how
many ranks each dimension of the device mesh spans, outermost first as torchtitan orders them
(pp, dp_replicate, dp_shard, cp, tp), and how the data-parallel ranks hold the model (DDP's
replicas, FSDP's shards, HSDP's replicas of shards). Built once a run knows its world, from the
config's `strategy` section and what the ranks chose where it says `auto`
(raylane.loop.distributed.parallelize), and held by the run's Strategy, which keeps why
(raylane.loop.distributed.fsdp). It names itself (`fsdp×tp2+sp`: the summary, the strategy line,
MLflow's tags), builds the device mesh, says which data-parallel rank a rank is, and is what a
checkpoint's manifest records and reads back (`record`, `from_record`, `resumed_from`), what
`raylane check --plan` shows (raylane.loop.plan_view) and what the checks before launch read
(raylane.layout_checks).

Torch-free at import: the checks before launch use it before torch is imported."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
NAMES = ("single", "ddp", "fsdp", "hsdp")


class LayoutError(ValueError):
    """Sizes the world does not divide, in one line naming the config's fields (a ConfigError
    before launch: raylane.layout_checks)."""


@dataclass(frozen=True)
class Layout:
    """How many ranks each mesh dimension spans, and how the data-parallel ranks hold the model
    (`name`: single for one process, ddp, fsdp, or hsdp: FSDP2 with replicas). `model_parallel`:
    the run's one five-dimensional mesh (always with tp, pp or cp over more than one rank; a
    one-rank mesh of all five for a check of that path on one device)."""

    name: str
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    model_parallel: bool = False
    ep: int = 1  # the data-parallel ranks one model's experts are split over (strategy.ep)

    def __post_init__(self) -> None:
        if self.pp * self.cp * self.tp > 1:
            object.__setattr__(self, "model_parallel", True)

    @classmethod
    def data_parallel_of(cls, name: str, world_size: int, replicas: int = 1, world: str | None = None) -> Layout:
        """Every rank holding whole layers: one process (`single`, whatever `name`), DDP's
        replicas, FSDP's shards, or with `replicas` > 1 (strategy.dp_replicate, or the nodes)
        HSDP's replicas of shards. LayoutError where `replicas` does not divide the world
        (`world`: as the user gave it)."""
        shards = _rest(world_size, replicate=replicas, world=world)
        if world_size == 1:
            return cls("single")
        if name == "ddp":
            return cls("ddp", dp_replicate=world_size)
        return cls("hsdp" if replicas > 1 else "fsdp", dp_replicate=replicas, dp_shard=shards)

    @classmethod
    def model_parallel_of(cls, s: Any, world_size: int, tp: int | None = None, world: str | None = None) -> Layout:
        """The (pp, dp_replicate, dp_shard, cp, tp) layout that strategy section `s` asks for on
        `world_size` ranks, dp_shard the rest, FSDP2 over the data-parallel ranks (HSDP with
        replicas); `tp`: the degree `tp: auto` chose. LayoutError where the sizes do not divide
        the world (`world`: as the user gave it)."""
        tp = tp or s.tp_degree
        shards = _rest(world_size, pp=s.pp, replicate=s.dp_replicate, cp=s.cp, tp=tp, world=world)
        return cls(
            "hsdp" if s.dp_replicate > 1 else "fsdp",
            pp=s.pp,
            dp_replicate=s.dp_replicate,
            dp_shard=shards,
            cp=s.cp,
            tp=tp,
            sequence_parallel=s.sequence_parallel,
            loss_parallel=s.loss_parallel,
            model_parallel=True,
        )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def data_parallel(self) -> int:
        """The ranks that read different batches (dp_replicate x dp_shard)."""
        return self.dp_replicate * self.dp_shard

    def data_rank(self, rank: int) -> int:
        """Which data-parallel rank `rank` is: the ranks of a tensor-parallel group (innermost), and
        a pipeline's stages (outermost), read the same batches."""
        return (rank // (self.cp * self.tp)) % self.data_parallel

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh's shape, as the summary's `mesh` gives it: (pp, dp_replicate, dp_shard,
        cp, tp) under model parallelism, else HSDP's (replicas, shards), FSDP's or DDP's (ranks),
        () for one process."""
        if self.model_parallel:
            return tuple(getattr(self, dim) for dim in MESH_DIMS)
        if self.name == "single":
            return ()
        return (self.dp_replicate, self.dp_shard) if self.name == "hsdp" else (self.world_size,)

    def label(self) -> str:
        """`fsdp×tp2+sp`, `ddp×tp2`, `hsdp×tp2×pp2`: the data-parallel flavour where more than one
        rank holds a share of the batch (`tp2` where one group is the whole world), then each
        model-parallel dimension over more than one rank (`+sp`, `+lp`: sequence, loss parallel)."""
        parts = [self.name] if self.data_parallel > 1 else []
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + "+sp" * self.sequence_parallel + "+lp" * self.loss_parallel)
        parts += [f"{dim}{n}" for dim, n in (("cp", self.cp), ("pp", self.pp), ("ep", self.ep)) if n > 1]
        return "×".join(parts) or self.name

    def mesh_text(self) -> str:
        """The mesh's dimensions beyond data parallelism's, `dp_shard 2, tp 2` (the data-parallel
        ones always, the others where they span more than one rank); "" without any."""
        if self.tp == self.cp == self.pp == 1:
            return ""
        dims = [(d, getattr(self, d)) for d in MESH_DIMS]
        return ", ".join(f"{d} {n}" for d, n in dims if n > 1 or d in ("dp_shard", "tp"))

    def described(self) -> str:
        """`fsdp×tp2 on 4`, or `one process`."""
        return "one process" if self.world_size == 1 else f"{self.label()} on {self.world_size}"

    # -- the checkpoint manifest's record ------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """The manifest's record of the layout (its train state's "layout"): the keys every record
        has held (the label as `strategy`, the flavour, tp, pp, the data-parallel size as `dp`,
        the world size), then every field, from which `from_record` gives this layout back."""
        fields = dataclasses.asdict(self)
        return {
            "strategy": self.label(),
            "name": self.name,
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.data_parallel,
            "world_size": self.world_size,
            **{k: v for k, v in fields.items() if k not in ("name", "tp", "pp")},
        }

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Layout:
        """The layout a manifest recorded (`record`). One written before every field was (issue
        61) holds its label, flavour, tp, pp, data-parallel size and world size: its flags are
        read from its label (`+sp`, `+lp`) and its flavour too (FSDP2 with replicas was recorded
        as `fsdp`, labelled `hsdp`); how HSDP's data-parallel ranks split into replicas and
        shards it never held, and they are read as shards (only named and compared, never laid
        out). ValueError for a record neither writes."""
        try:
            if "dp_shard" in record:  # a field newer than the record (ep) keeps its default
                return cls(**{f.name: record[f.name] for f in dataclasses.fields(cls) if f.name in record})
            label, dp, tp, pp = str(record["strategy"]), int(record["dp"]), int(record["tp"]), int(record["pp"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a layout record: {record!r}") from exc
        head = label.split("×")[0]
        name = head if head in NAMES else str(record["name"])
        replicate, shard = (dp, 1) if name == "ddp" else (1, dp)
        return cls(
            name,
            pp=pp,
            dp_replicate=replicate,
            dp_shard=shard,
            tp=tp,
            sequence_parallel="+sp" in label,
            loss_parallel="+lp" in label,
        )

    def _saved(self, record: Any) -> Layout | None:
        """`record` read (None where it is missing or not one: the world size alone tells then)."""
        if not isinstance(record, dict):
            return None
        try:
            return self.from_record(record)
        except ValueError:
            return None

    def same_as(self, record: Any) -> bool:
        """Whether a checkpoint that recorded `record` was saved at this layout, as restoring its
        random generators needs (raylane.loop.checkpoint.loading): the same label on as many ranks,
        as every record can say (an HSDP checkpoint from before the whole record holds no split).
        True where there is no record: the world size alone decides there."""
        was = self._saved(record)
        return was is None or (was.label(), was.world_size) == (self.label(), self.world_size)

    def resumed_from(self, train_state: dict[str, Any]) -> str | None:
        """`resuming a fsdp×tp2 checkpoint of 4 ranks as ddp on 2`: what resuming a checkpoint (its
        `train_state`) at this layout says; None at the layout that saved it. A checkpoint from
        before the layout record has its world size alone: `resuming a checkpoint of 2 ranks as
        one process`, nothing at the same world size."""
        was = self._saved(train_state.get("layout"))
        if was is not None:
            if self.same_as(train_state["layout"]):
                return None
            what = "one-process checkpoint" if was.world_size == 1 else f"{was.label()} checkpoint"
            return f"resuming a {what} of {_ranks(was.world_size)} as {self.described()}"
        world = train_state.get("world_size")
        if not isinstance(world, int) or world == self.world_size:
            return None
        return f"resuming a checkpoint of {_ranks(world)} as {self.described()}"

    # -- on the ranks: the mesh and the step's context -----------------------------------------

    def device_mesh(self, device_type: str) -> Any:
        """The run's device mesh. Collective: every rank makes its groups. Under model parallelism
        the one mesh over (pp, dp_replicate, dp_shard, cp, tp), size-1 dims kept, with flattened
        views: `batch` (dp_replicate x dp_shard: who reads which data), `fsdp` (dp_shard x cp:
        FSDP2's shards) and `loss` (batch x cp: over whom the loss averages); else FSDP's
        (`shard`) or HSDP's (`replicate`, `shard`); None under DDP and in one process (the
        default group serves)."""
        from torch.distributed.device_mesh import init_device_mesh

        # A rehearsal lays a meta model out on fake groups (raylane.loop.rehearsal): its
        # mesh is the CPU's (FSDP2 asks a mesh for its device's handle; the meta device has none).
        device_type = "cpu" if device_type == "meta" else device_type
        if not self.model_parallel:
            if self.name not in ("fsdp", "hsdp"):
                return None
            names = ("replicate", "shard") if self.name == "hsdp" else ("shard",)
            return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=names)
        mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=MESH_DIMS)
        # torch keeps flattened views apart from the mesh (slicing them from it is deprecated)
        mesh.views = {  # type: ignore[attr-defined]
            "batch": mesh["dp_replicate", "dp_shard"]._flatten("batch"),
            "fsdp": mesh["dp_shard", "cp"]._flatten("fsdp"),
            "loss": mesh["dp_replicate", "dp_shard", "cp"]._flatten("loss"),
        }
        return mesh

    def fsdp_mesh(self, mesh: Any) -> Any:
        """FSDP2's part of `mesh` (this layout's `device_mesh`): the shards, or (replicas, shards)
        for HSDP; the mesh itself without model parallelism."""
        if not self.model_parallel:
            return mesh
        if self.dp_replicate > 1:
            return mesh["dp_replicate", "dp_shard"]  # (with context parallelism: dp_shard x cp, flattened)
        return mesh.views["fsdp"]

    def step_context(self) -> Any:
        """What a training step's forward, loss and backward run in (`loss_context`)."""
        return loss_context(self.tp > 1 and self.loss_parallel)


def loss_context(loss_parallel: bool) -> Any:
    """torch's loss_parallel, whose cross-entropy takes the head's vocabulary-split logits
    (backward included), under loss parallelism; else nothing."""
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as context

        return context()
    import contextlib

    return contextlib.nullcontext()


def _rest(
    world_size: int, *, pp: int = 1, replicate: int = 1, cp: int = 1, tp: int = 1, world: str | None = None
) -> int:
    """The ranks left for FSDP's shards once the other dimensions took theirs; LayoutError naming
    the config's fields where their product does not divide the world."""
    group = pp * replicate * cp * tp
    if world_size % group == 0:
        return world_size // group
    world = world or f"the {world_size} ranks"
    if group == tp:
        raise LayoutError(f"strategy.tp = {tp}: does not divide {world} (a tensor-parallel group is tp ranks)")
    sizes = (("pp", pp), ("dp_replicate", replicate), ("cp", cp), ("tp", tp))
    named = " x ".join(f"strategy.{k} = {n}" for k, n in sizes if n > 1)
    raise LayoutError(f"{named}: {group} ranks do not divide {world}")


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"
