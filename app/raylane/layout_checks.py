"""The layout checks run before any work starts: `strategy.tp`, `strategy.pp` and
`strategy.dp_replicate` on the number of ranks a run will have (a world they divide, replicas
through FSDP2, map-style data, a pipeline that gives a tp_plan or pp_stages). raylane.prepare calls
`check_layout` beside raylane.prechecks' checks; each failure is one ConfigError naming the field
and the value; nothing here imports torch or Ray."""

from __future__ import annotations

from raylane import pipelines_ref
from raylane.config import BaseConfig, ConfigError


def check_layout(cfg: BaseConfig, world_size: int, world: str, pipeline: pipelines_ref.Resolved | None = None) -> None:
    """`strategy.tp` on `world_size` ranks (`world`: where that number comes from, as the user
    set it): a world it divides, replicas only through FSDP2, map-style data, and a pipeline that
    gives a tp_plan. The checks of the config alone are its validators' (raylane.config.base).
    `pipeline`: the config's, as the launch looked it up once (raylane.prepare; None: looked up here)."""
    pipeline = pipeline or pipelines_ref.resolve(cfg.pipeline)
    _check_pipeline_layout(cfg, world_size, world, pipeline)
    tp = cfg.strategy.tp
    if not cfg.strategy.tensor_parallel:
        return
    label = pipeline.label
    if tp == "auto":  # any degree of the node's ranks may be chosen; one without a plan is not tried
        if pipeline.streams:
            raise ConfigError(
                f"strategy.tp = 'auto': the {label} pipeline streams its data (sources), split by rank, and the "
                "ranks of a tensor-parallel group must read the same batches; give strategy.tp: 1"
            )
        return
    if world_size % tp:
        raise ConfigError(f"strategy.tp = {tp}: does not divide {world} (a tensor-parallel group is tp ranks)")
    replicas = world_size // tp
    if cfg.strategy.name == "ddp" and replicas > 1:
        raise ConfigError(
            f"strategy.tp = {tp} with strategy.name = 'ddp' on {world_size} ranks: torch's DDP does not take "
            f"tensor-parallel weights, and replicas through FSDP2 are not built yet; use strategy.name: fsdp "
            f"(FSDP2 over the {replicas} data-parallel ranks)"
        )
    if pipeline.streams:
        raise ConfigError(
            f"strategy.tp = {tp}: the {label} pipeline streams its data (sources), split by rank, and the "
            "ranks of a tensor-parallel group must read the same batches; tensor parallelism needs a map-style dataset"
        )
    if cfg.gives_tp_plan() is False:
        raise ConfigError(
            f"strategy.tp = {tp}: the {label} pipeline gives no tp_plan (which layers tensor parallelism "
            "splits): give its Pipeline a tp_plan (docs/strategies.md, Tensor parallelism)"
        )


def _check_pipeline_layout(cfg: BaseConfig, world_size: int, world: str, pipeline: pipelines_ref.Resolved) -> None:
    """`strategy.pp` and `strategy.dp_replicate` on `world_size` ranks: a world that splits into
    pp x dp_replicate x tp, data-parallel replicas through FSDP2, map-style data, and a pipeline
    that says how its model splits into stages."""
    s = cfg.strategy
    if s.pp == 1 and s.dp_replicate == 1:
        return
    label = pipeline.label
    group = s.pp * s.dp_replicate * s.tp_degree
    if world_size % group:
        sizes = " x ".join(
            f"strategy.{k} = {n}"
            for k, n in (("pp", s.pp), ("dp_replicate", s.dp_replicate), ("tp", s.tp_degree))
            if n > 1
        )
        raise ConfigError(f"{sizes}: {group} ranks do not divide {world}")
    if s.pp == 1:
        return
    replicas = world_size // (s.pp * s.tp_degree)
    if s.name == "ddp" and replicas > 1:
        raise ConfigError(
            f"strategy.pp = {s.pp} with strategy.name = 'ddp' on {world_size} ranks: the {replicas} data-parallel "
            "replicas of each stage are FSDP2's; use strategy.name: fsdp"
        )
    if pipeline.streams:
        raise ConfigError(
            f"strategy.pp = {s.pp}: the {label} pipeline streams its data (sources), split by rank, and the "
            "stages of a pipeline must read the same batches; pipeline parallelism needs a map-style dataset"
        )
    if cfg.gives_pp_stages() is False:
        raise ConfigError(
            f"strategy.pp = {s.pp}: the {label} pipeline gives no pp_stages (how its model splits into "
            "stages): give its Pipeline pp_stages='auto' or lists of module names (docs/strategies.md, Pipeline "
            "parallelism)"
        )


def check_plan(cfg: BaseConfig, world_size: int) -> list[str]:
    """A model-parallel run's plan and stages on its model, as `raylane check --plan` shows them
    (raylane.loop.plan_view): the pipeline's build(cfg) run here with the model on the meta device,
    so that a rule naming no module, a style that is none, heads that tp does not divide, tied
    weights split apart or more stages than blocks is one ConfigError before any worker starts,
    for a user's pipeline as for a shipped one. Returns the lines to show when the model could not
    be looked at here (build() failing on this machine, which may lack what the ranks have: the
    run goes on, and says so). Nothing for a run without tp or pp. The same in a process that
    trains next (a torchrun rank): the forward on a fake process group leaves it as it found it
    (raylane.loop.distributed.layout.fake_work)."""
    s = cfg.strategy
    if not (s.tensor_parallel or s.pp > 1):
        return []
    from raylane.loop.meta_build import Unchecked
    from raylane.loop.plan_view import pipeline_plan
    from raylane.pipelines_ref import UserCodeError

    try:
        pipeline_plan(cfg, world_size)
    except Unchecked as exc:
        return [f"raylane: the plan and stages are not checked before launch: {exc}"]
    except UserCodeError as exc:
        if isinstance(exc.__cause__, ConfigError):  # build()'s own refusal of the config: the ranks' too
            raise ConfigError(str(exc.__cause__)) from None
        return [f"raylane: the plan and stages are not checked before launch: {exc}"]
    except ValueError as exc:  # one line naming the rule or the key (ConfigError's among them)
        raise ConfigError(str(exc)) from None
    return []
