"""The `fault_tolerance:` section: replica groups whose failures cost one group, not the run
(torchft's quorum and live healing; docs/fault-tolerance.md). Apart from `failure:` because it
changes the run's shape (the world split into groups, each restarting alone), where `failure:`
only counts restarts of the whole. Names after torchtitan's. Nothing here imports torch, torchft
or Ray."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raylane.config.section import Section


class SemiSyncSection(Section):
    """Semi-synchronous training across the replica groups: each group steps on its own and the
    groups meet every `sync_steps` steps (for slow links between groups)."""

    method: Literal["none", "local_sgd", "diloco"] = Field(
        "none",
        description="none: the groups average gradients every step (fault-tolerant HSDP). local_sgd: they average "
        "their parameters every `sync_steps` steps. diloco: DiLoCo, an outer optimizer (Nesterov SGD) steps on the "
        "groups' averaged parameter change every `sync_steps` steps (torchft's LocalSGD and DiLoCo).",
    )
    sync_steps: int = Field(10, ge=1, le=100_000, description="Steps between two synchronizations of the groups.")
    outer_lr: float = Field(0.7, gt=0, le=100, description="diloco: the outer optimizer's learning rate.")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="diloco: the outer optimizer's momentum.")
    outer_nesterov: bool = Field(True, description="diloco: Nesterov momentum for the outer optimizer.")


class FaultToleranceSection(Section):
    """Replica groups that fail and heal alone (docs/fault-tolerance.md)."""

    enabled: bool = Field(
        False,
        description="Split the run into `replica_groups` groups of workers that each restart alone: a lost worker "
        "costs its group a restart while the others keep stepping, and the group heals from a live peer's "
        "weights and optimizer state, not from storage. On Ray only; needs `raylane[fault-tolerance]` (torchft).",
    )
    replica_groups: int = Field(
        2,
        ge=1,
        le=1024,
        description="How many groups `scaling.num_workers` is split into (it must divide it). Inside a group the "
        "layout is `strategy`'s (DDP, FSDP, FSDP x TP); across groups gradients are averaged by torchft, in place "
        "of `strategy.dp_replicate`.",
    )
    min_replicas: int = Field(
        1,
        ge=1,
        le=1024,
        description="The fewest groups that may step: below it the groups wait (up to `quorum_timeout_s`) for "
        "another to come back.",
    )
    process_group: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="The groups' own process group, across groups: auto is nccl with `scaling.use_gpu`, else gloo. "
        "Inside a group it is the run's usual one.",
    )
    timeout_s: float = Field(
        60.0, gt=0, le=86_400, description="Seconds an operation across groups (an all-reduce, a heal) may take."
    )
    quorum_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86_400,
        description="Seconds a group waits for a quorum of `min_replicas` groups before it fails (a busy machine's "
        "restarts take tens of seconds).",
    )
    connect_timeout_s: float = Field(
        60.0, gt=0, le=86_400, description="Seconds a group may take to reach the lighthouse and its peers."
    )
    heartbeat_timeout_s: float = Field(
        2.0,
        gt=0,
        le=3_600,
        description="Seconds of silence after which the lighthouse counts a group gone: about how long a group's "
        "death stalls the others (torchft's default, 5 s, stalled them 5 s).",
    )
    join_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3_600,
        description="Seconds the lighthouse waits for a live group that has not yet asked to join a quorum.",
    )
    semi_sync: SemiSyncSection = SemiSyncSection()

    @model_validator(mode="after")
    def _floor(self) -> FaultToleranceSection:
        if self.min_replicas > self.replica_groups:
            raise ValueError(
                f"fault_tolerance.min_replicas = {self.min_replicas}: above fault_tolerance.replica_groups = "
                f"{self.replica_groups}; no quorum could form"
            )
        return self

    def group_size(self, num_workers: int) -> int:
        """Workers per replica group (the section's check across sections makes it whole)."""
        return num_workers // self.replica_groups

    def pg_backend(self, use_gpu: bool) -> Literal["gloo", "nccl"]:
        if self.process_group == "auto":
            return "nccl" if use_gpu else "gloo"
        return self.process_group
