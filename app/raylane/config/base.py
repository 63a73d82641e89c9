"""`BaseConfig`: the typed config tree a pipeline's `Config` extends with its own `model`
section, made of the shared sections (raylane.config.sections), with the checks across sections
and the tree's dotted keys (`flat`: the keys of `--set`, a sweep's space and MLflow's params).
Reading YAML and `--set` into it is raylane.config.load's. Nothing here imports torch or Ray."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from typing import Any

from pydantic import Field, field_validator, model_validator

from raylane import pipelines_ref
from raylane.config import observe, sections
from raylane.config.fault_tolerance import FaultToleranceSection
from raylane.config.strategy import SINGLE_STAGE_SCHEDULES, V_SCHEDULES
from raylane.config.workerenv import check_entries as check_env_entries


class BaseConfig(sections.Section):
    """Sections shared by every pipeline; each pipeline adds its own `model` section."""

    pipeline: str = Field(
        description="The pipeline: a shipped one's name (regression, digits, gpt, tabular, text, hf), a dotted "
        "module, or a `.py` file (relative to the config file's folder)."
    )
    run: sections.RunSection = sections.RunSection()
    scaling: sections.ScalingSection = sections.ScalingSection()
    strategy: sections.StrategySection = sections.StrategySection()
    train: sections.TrainSection = sections.TrainSection()
    optim: sections.OptimSection = sections.OptimSection()
    loader: sections.LoaderSection = sections.LoaderSection()
    checkpoint: sections.CheckpointSection = sections.CheckpointSection()
    failure: sections.FailureSection = sections.FailureSection()
    dist: sections.DistSection = sections.DistSection()
    mlflow: sections.MlflowSection = sections.MlflowSection()
    profile: observe.ProfileSection = observe.ProfileSection()
    stragglers: observe.StragglersSection = observe.StragglersSection()
    fault_tolerance: FaultToleranceSection = FaultToleranceSection()
    env: dict[str, str] = Field(
        {},
        description="Environment variables every rank gets (`NCCL_DEBUG: INFO`, `HF_TOKEN: ${HF_TOKEN}`): set in "
        "each Ray worker before its process group starts, or in each torchrun / `--local` process. A value "
        "written `${NAME}` is read from the driver's environment at launch and recorded only as `${NAME}` "
        "(MLflow, the run's record, checkpoints): the way to hand the ranks a secret.",
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, value: Any) -> Any:
        if not isinstance(value, Mapping):
            return value  # pydantic names the type it expected
        return check_env_entries(value)

    @model_validator(mode="after")
    def _compatible(self) -> BaseConfig:
        if self.train.precision == "fp16" and self.strategy.name != "ddp":
            raise ValueError(
                f"train.precision = 'fp16' with strategy.name = {self.strategy.name!r}: "
                "the gradient scaler does not handle sharded gradients; use bf16"
            )
        if self.strategy.comm_hook == "bf16" and not self.scaling.use_gpu:
            raise ValueError("strategy.comm_hook = 'bf16' needs scaling.use_gpu: true (NCCL); on CPU use fp16")
        if self.strategy.cpu_offload and (self.strategy.name == "ddp" or not self.scaling.use_gpu):
            raise ValueError(
                "strategy.cpu_offload = True needs strategy.name: fsdp or auto, "
                "and scaling.use_gpu: true (on CPU there is nothing to offload to)"
            )
        if self.loader.pin_memory and not self.scaling.use_gpu:
            raise ValueError(
                "loader.pin_memory = True needs scaling.use_gpu: true (pinned memory speeds up copies "
                "to a GPU; on CPU there are none)"
            )
        return self

    @model_validator(mode="after")
    def _tensor_parallel(self) -> BaseConfig:
        """What tensor parallelism does not combine with yet, refused by the key that asks for it."""
        s, tp = self.strategy, self.strategy.tp
        for key, on in (("sequence_parallel", s.sequence_parallel), ("loss_parallel", s.loss_parallel)):
            if on and not s.tensor_parallel:
                raise ValueError(
                    f"strategy.{key} = True needs strategy.tp > 1 (it shards the "
                    f"{'sequence' if key == 'sequence_parallel' else 'vocabulary'} between tensor-parallel layers)"
                )
        self._context_parallel()
        if not s.tensor_parallel:
            return self
        auto = tp == "auto"
        refused = {
            "strategy.name = 'auto'": (
                s.name == "auto" and not auto,
                "the memory estimate chooses tp only with strategy.tp: auto; name ddp or fsdp, or set tp: auto",
            ),
            "strategy.name = 'ddp'": (
                s.name == "ddp" and auto,
                "replicas of a tensor-parallel model by DDP are not built; use auto (DDP when a replica fits) or fsdp",
            ),
            f"train.global_batch = {self.train.global_batch}": (
                auto and self.train.global_batch is not None,
                "the data-parallel ranks that hold it are chosen on the ranks; give a number for tp",
            ),
            "train.precision = 'fp16'": (
                self.train.precision == "fp16",
                "the gradient scaler does not handle tensor-parallel gradients; use bf16",
            ),
            f"scaling.num_workers = {[self.scaling.min_workers, self.scaling.num_workers]}": (
                self.scaling.elastic,
                "elastic runs keep no tensor-parallel layout yet; give one number of workers",
            ),
            f"strategy.comm_hook = {s.comm_hook!r}": (
                s.comm_hook != "none",
                "it compresses DDP's all-reduce, which a tensor-parallel run does not use",
            ),
            "strategy.cpu_offload = True": (s.cpu_offload, "offloading a tensor-parallel model is not built yet"),
            f"scaling.gpus_per_worker = {self.scaling.gpus_per_worker:g}": (
                self.scaling.use_gpu and self.scaling.gpus_per_worker < 1,
                "NCCL cannot run two ranks of a tensor-parallel group on one GPU",
            ),
        }
        for key, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"{key} with strategy.tp = {tp!r}: {why}")
        return self

    def _context_parallel(self) -> None:
        """torch's context parallelism shards attention with ring attention, which exists only for
        CUDA's flash, efficient and cuDNN SDPA kernels (issue 49's study: on CPU it fails in the
        first forward); raylane does not build it on GPU yet either."""
        cp = self.strategy.cp
        if cp == 1:
            return
        if not self.scaling.use_gpu:
            raise ValueError(
                f"strategy.cp = {cp}: context parallelism needs CUDA's SDPA kernels (ring attention), which a CPU "
                "run does not have; use strategy.cp: 1"
            )
        raise ValueError(f"strategy.cp = {cp}: context parallelism is not built yet; use strategy.cp: 1")

    @model_validator(mode="after")
    def _replica_groups(self) -> BaseConfig:
        """What replica groups need of the rest of the config: whole groups, and none of what they
        do not combine with yet (docs/fault-tolerance.md), each refused by the key that asks for it."""
        ft, s, workers = self.fault_tolerance, self.strategy, self.scaling.num_workers
        if not ft.enabled:
            return self
        if workers % ft.replica_groups:
            raise ValueError(
                f"fault_tolerance.replica_groups = {ft.replica_groups}: does not divide scaling.num_workers = "
                f"{workers} (every group has as many workers)"
            )
        refused = {
            f"scaling.num_workers = {[self.scaling.min_workers, workers]}": (
                self.scaling.elastic,
                "an elastic run with replica groups is not built yet: the groups are the unit that comes and goes; "
                "give one number",
            ),
            f"strategy.pp = {s.pp}": (s.pp > 1, "pipeline stages inside a replica group are not built yet"),
            f"strategy.dp_replicate = {s.dp_replicate}": (
                s.dp_replicate > 1,
                "the replica groups are the replicas (torchft averages gradients across them); use 1",
            ),
            "fault_tolerance.process_group = 'nccl'": (
                ft.process_group == "nccl" and not self.scaling.use_gpu,
                "NCCL needs scaling.use_gpu: true; on CPU use gloo",
            ),
        }
        for key, (on, why) in refused.items():
            if on:
                raise ValueError(f"{key} with fault_tolerance.enabled: {why}")
        return self

    @model_validator(mode="after")
    def _pipeline_parallel(self) -> BaseConfig:
        """What pipeline parallelism needs of the config alone: stages per rank its schedule runs,
        micro-batches that cut the batch evenly, and what it does not combine with yet."""
        s = self.strategy
        if s.dp_replicate > 1 and s.name != "fsdp":
            raise ValueError(
                f"strategy.dp_replicate = {s.dp_replicate} with strategy.name = {s.name!r}: replicas of a sharded "
                "model are FSDP2's (HSDP); use strategy.name: fsdp"
            )
        if s.pp == 1:
            return self
        stages, schedule = s.stages_per_rank, s.pp_schedule
        if schedule in SINGLE_STAGE_SCHEDULES and stages != 1:
            raise ValueError(
                f"strategy.pp_stages_per_rank = {stages} with strategy.pp_schedule = {schedule!r}: that schedule "
                "runs one stage per rank; use 1, or a multi-stage schedule (Interleaved1F1B, ...)"
            )
        if schedule not in SINGLE_STAGE_SCHEDULES and (stages < 2 or (schedule in V_SCHEDULES and stages != 2)):
            need = "exactly 2" if schedule in V_SCHEDULES else "2 or more"
            raise ValueError(
                f"strategy.pp_stages_per_rank = {stages} with strategy.pp_schedule = {schedule!r}: that schedule "
                f"runs {need} stages per rank; use 1F1B or GPipe for one"
            )
        if self.train.batch_size % s.microbatches:
            raise ValueError(
                f"strategy.pp_microbatches = {s.microbatches}: does not divide train.batch_size = "
                f"{self.train.batch_size} (each micro-batch of a pipeline step is batch_size / pp_microbatches rows)"
            )
        refused = {
            "strategy.name = 'auto'": (s.name == "auto", "the memory estimate does not count pipeline stages yet"),
            "strategy.tp = 'auto'": (s.tp == "auto", "the memory estimate does not count pipeline stages yet"),
            "train.precision = 'fp16'": (
                self.train.precision == "fp16",
                "the gradient scaler does not run through a pipeline schedule; use bf16",
            ),
            f"scaling.num_workers = {[self.scaling.min_workers, self.scaling.num_workers]}": (
                self.scaling.elastic,
                "elastic runs keep no pipeline layout yet; give one number of workers",
            ),
            f"strategy.comm_hook = {s.comm_hook!r}": (s.comm_hook != "none", "a pipelined run does not use DDP"),
            "strategy.cpu_offload = True": (s.cpu_offload, "offloading pipeline stages is not built yet"),
            f"scaling.gpus_per_worker = {self.scaling.gpus_per_worker:g}": (
                self.scaling.use_gpu and self.scaling.gpus_per_worker < 1,
                "NCCL cannot run two ranks of a pipeline on one GPU",
            ),
        }
        for key, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"{key} with strategy.pp = {s.pp}: {why}")
        return self

    def gives_pp_stages(self) -> bool | None:
        """Whether this pipeline's `build` gives a Pipeline.pp_stages (how its model splits into
        pipeline stages), so that `strategy.pp` > 1 on one that gives none fails before the run.
        None (the default): checked on the ranks."""
        return None

    def gives_tp_plan(self) -> bool | None:
        """Whether this pipeline's `build` gives a Pipeline.tp_plan (which layers tensor parallelism
        splits), so that `strategy.tp` > 1 on one that gives none fails before the run. None (the
        default, for pipelines that declare nothing): checked on the ranks."""
        return None

    def gives_ep_plan(self) -> bool | None:
        """Whether this pipeline's `build` gives a Pipeline.ep_plan (which modules are its experts),
        so that `strategy.ep` > 1 on one that gives none fails at once. None (the default, for
        pipelines that declare nothing): found when the model is built for the checks before launch
        (raylane.layout_checks.check_plan)."""
        return None

    def eval_metrics(self) -> tuple[str, ...] | None:
        """The held-out metrics this pipeline's `eval_sums` reports, so that a `sweep.metric` or
        `checkpoint.best_metric` it never reports fails before the run rather than after it.
        None (the default, for pipelines that declare nothing): not checked."""
        return None

    def flat(self) -> dict[str, Any]:
        """Dotted keys -> values: the same keys as `--set`, Tune spaces and MLflow params."""
        return flatten(self.model_dump(mode="json"))

    def with_run_name(self) -> BaseConfig:
        """A copy whose `run.name` is set: a generated one when the user gave none."""
        if self.run.name:
            return self
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        return self.model_copy(
            update={"run": self.run.model_copy(update={"name": f"{pipelines_ref.label(self.pipeline)}-{stamp}"})}
        )


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping's leaves under dotted keys (`{"a": {"b": 1}}` -> `{"a.b": 1}`)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out
