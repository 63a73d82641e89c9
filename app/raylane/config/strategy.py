"""The `strategy:` section: how the model is spread over the workers (DDP or FSDP, tensor, pipeline,
context and expert parallelism, HSDP replicas) and the pipeline schedules it names. Re-exported by
raylane.config.sections and raylane.config. Nothing here imports torch or Ray."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from raylane.config.section import Section

# Pipeline schedules that run one stage per rank; the others run two or more (V-shaped: exactly 2).
SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


class StrategySection(Section):
    """How the model is spread over the workers: DDP or FSDP, tensor parallelism, and their settings."""

    name: Literal["ddp", "fsdp", "auto"] = Field(
        "ddp",
        description="`ddp`: a full replica per rank. `fsdp`: FSDP2, with parameters, gradients and optimizer state "
        "sharded (HSDP across nodes). `auto`: estimates the memory and picks DDP when a replica fits "
        "with margin, else FSDP.",
    )
    tp: int | Literal["auto"] = Field(
        1,
        description="Tensor-parallel degree: each block's weights split over this many consecutive ranks (1: off), "
        "which see the same batches; the data-parallel ranks are the ranks / tp, and `name` is how they hold "
        "the model. Needs a pipeline that gives a `tp_plan` and a world it divides (docs/strategies.md, Tensor "
        "parallelism). `auto`: the memory estimate picks the simplest layout that fits: DDP (with `name: auto`), "
        "then FSDP, then FSDP x TP with the smallest tp that fits.",
    )
    sequence_parallel: bool = Field(
        False,
        description="With `tp` > 1: the norms, dropout and residual stream between the tensor-parallel layers "
        "sharded along the sequence (less activation memory, the same results). Needs a `tp_plan(model, "
        "sequence_parallel)` function that lays them out; a dict plan is refused before launch.",
    )
    pp: int = Field(
        1,
        ge=1,
        le=1024,
        description="Pipeline-parallel degree: the model's blocks split into stages over this many groups of ranks "
        "(1: off), which see the same batches; the data-parallel ranks are the ranks / (pp x tp). Needs a pipeline "
        "that gives `pp_stages` (docs/strategies.md, Pipeline parallelism).",
    )
    pp_schedule: Literal[
        "1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"
    ] = Field(
        "1F1B",
        description="With `pp` > 1: torch.distributed.pipelining's schedule. `1F1B` and `GPipe` run one stage per "
        "rank; `Interleaved1F1B`, `LoopedBFS`, `InterleavedZeroBubble`, `ZBVZeroBubble` and `DualPipeV` run "
        "`pp_stages_per_rank` (2 or more) and leave a smaller bubble.",
    )
    pp_microbatches: int | None = Field(
        None,
        ge=1,
        le=65_536,
        description="With `pp` > 1: the micro-batches each `train.batch_size` is cut into, in flight through the "
        "stages at once; must divide `train.batch_size`. null: the number of stages (pp x pp_stages_per_rank).",
    )
    pp_stages_per_rank: int | None = Field(
        None,
        ge=1,
        le=64,
        description="With `pp` > 1: stages each rank holds. null: 1 for `1F1B` and `GPipe`, 2 for the other "
        "schedules (which need 2 or more; `ZBVZeroBubble` and `DualPipeV` exactly 2).",
    )
    dp_replicate: int = Field(
        1,
        ge=1,
        le=1_000_000,
        description="Replicas of the sharded model (HSDP): FSDP2 shards over the data-parallel ranks / dp_replicate "
        "and replicates over dp_replicate groups of them (1: shard over all; FSDP across nodes is HSDP already). "
        "Needs `name: fsdp`.",
    )
    loss_parallel: bool = Field(
        False,
        description="With `tp` > 1: the head's logits stay split over the vocabulary and the cross-entropy runs "
        "on the split (torch's loss_parallel), never gathering the whole vocabulary; evaluation gathers them.",
    )
    cp: int = Field(
        1,
        ge=1,
        le=1024,
        description="Context-parallel degree (each sample's sequence split over this many ranks, ring attention): "
        "needs CUDA's SDPA kernels, refused on CPU; not built yet on GPU (1: off).",
    )

    ep: int | Literal["auto"] = Field(
        1,
        description="Expert-parallel degree: a mixture of experts' experts split over this many data-parallel "
        "ranks (1: off), each holding experts / ep of every experts module, the tokens each rank's router sends "
        "to an expert moved to the rank that holds it and back (all-to-all); the dense layers stay as `name` "
        "holds them over all the data-parallel ranks, and with FSDP the experts are also sharded over the "
        "data-parallel ranks / ep. Needs a pipeline that gives an `ep_plan`, and a number of experts and of "
        "data-parallel ranks it divides; not yet with `tp`, `pp`, `dp_replicate`, `name: auto`, replica groups or "
        "elastic runs (docs/strategies.md, Expert parallelism). `auto`: the memory estimate picks, on the ranks, the "
        "smallest degree dividing the data-parallel ranks and every experts module's experts at which a rank's "
        "share fits its device (1 where every expert fits on every rank, and for a model without experts).",
    )
    ep_capacity_factor: float | None = Field(
        None,
        gt=0,
        description="With `ep` > 1: each rank sends each expert at most ceil(factor x its tokens x top-k / experts) "
        "of its (token, expert) pairs a forward, its first in the batch's order, and drops the rest (their output 0, "
        "the residual carrying the token on; counted in train/experts/dropped_tokens and the summary). null: none "
        "dropped, at the cost that a rank may receive every rank's tokens for its experts, up to tokens x top-k x ep "
        "rows of the hidden size (and their activations) where it holds tokens x top-k on average; a factor c bounds "
        "that to c x tokens x top-k.",
    )

    @field_validator("tp")
    @classmethod
    def _tp_range(cls, tp: int | str) -> int | str:
        if isinstance(tp, int) and not 1 <= tp <= 1024:
            raise ValueError(f"strategy.tp = {tp}: a degree from 1 to 1024, or auto")
        return tp

    @field_validator("ep")
    @classmethod
    def _ep_range(cls, ep: int | str) -> int | str:
        if isinstance(ep, int) and not 1 <= ep <= 1024:
            raise ValueError(f"strategy.ep = {ep}: a degree from 1 to 1024, or auto")
        return ep

    @model_validator(mode="after")
    def _expert_parallel(self) -> StrategySection:
        """What expert parallelism does not combine with yet, refused by the key that asks for it:
        the experts split over ranks borrowed from the data-parallel ones, which tp, pp and HSDP's
        replicas would lay out again, and a memory estimate that counts every expert on every rank."""
        ep = self.ep
        if ep == 1 and self.ep_capacity_factor is not None:
            raise ValueError(
                f"strategy.ep_capacity_factor = {self.ep_capacity_factor} with strategy.ep = 1: the capacity caps the "
                "tokens expert parallelism sends to each expert; set strategy.ep > 1, or remove it"
            )
        if not self.expert_parallel:
            return self
        refused = {
            f"strategy.tp = {self.tp!r}": (
                self.tp == "auto" or self.tp > 1,
                "expert parallelism beside tensor parallelism is not supported yet; use strategy.tp: 1 (the dense "
                "layers sharded by FSDP), or strategy.ep: 1",
            ),
            f"strategy.pp = {self.pp}": (
                self.pp > 1,
                "expert parallelism inside pipeline stages is not supported yet; use strategy.pp: 1 (the dense "
                "layers sharded by FSDP), or strategy.ep: 1",
            ),
            f"strategy.dp_replicate = {self.dp_replicate}": (
                self.dp_replicate > 1,
                "expert parallelism with HSDP's replicas is not supported yet; use strategy.dp_replicate: 1",
            ),
            "strategy.name = 'auto'": (
                self.name == "auto",
                "the memory estimate counts every expert on every rank; name ddp or fsdp",
            ),
        }
        for key, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"{key} with strategy.ep = {ep!r}: {why}")
        return self

    @property
    def expert_parallel(self) -> bool:
        """Whether the layout may split experts over ranks: `ep` > 1, or `auto`."""
        return self.ep == "auto" or self.ep > 1

    @property
    def ep_degree(self) -> int:
        """`ep` as a number, where the config fixes one (1 for `auto`: chosen on the ranks)."""
        return 1 if self.ep == "auto" else self.ep

    @property
    def tensor_parallel(self) -> bool:
        """Whether the layout may split blocks over ranks: `tp` > 1, or `auto`."""
        return self.tp == "auto" or self.tp > 1

    @property
    def tp_degree(self) -> int:
        """`tp` as a number, where the config fixes one (1 for `auto`: chosen on the ranks)."""
        return 1 if self.tp == "auto" else self.tp

    reshard_after_forward: bool = Field(
        True,
        description="FSDP: free the gathered parameters after each block's forward (less memory, one more "
        "all-gather in backward).",
    )
    cpu_offload: bool = Field(
        False,
        description="FSDP: keep the sharded parameters, gradients and optimizer state in host memory (needs "
        "`scaling.use_gpu`).",
    )
    # The DDP settings below are those of the PyTorch DDP paper.
    bucket_cap_mb: float = Field(25.0, gt=0, le=100_000, description="DDP: the size of a gradient bucket, in MB.")
    gradient_as_bucket_view: bool = Field(
        False, description="DDP: gradients as views into the buckets, which saves one copy of the gradients."
    )
    static_graph: bool = Field(False, description="DDP: the model's graph never changes between steps.")
    find_unused_parameters: bool = Field(
        False, description="DDP: look for parameters that get no gradient in a step (slower; needed when some do)."
    )
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="DDP: compress gradients before the all-reduce (`bf16` needs `scaling.use_gpu`)."
    )
    powersgd_rank: int = Field(
        1, ge=1, le=1024, description="DDP with `comm_hook: powersgd`: the rank of PowerSGD's low-rank approximation."
    )

    @property
    def stages_per_rank(self) -> int:
        """`pp_stages_per_rank`, or the schedule's default: 1 for single-stage schedules, else 2."""
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 1 if self.pp_schedule in SINGLE_STAGE_SCHEDULES else 2

    @property
    def microbatches(self) -> int:
        """`pp_microbatches`, or one per stage."""
        return self.pp_microbatches or self.pp * self.stages_per_rank
