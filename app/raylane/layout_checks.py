"""The layout checks run before any work starts: `strategy.tp`, `strategy.pp`,
`strategy.dp_replicate` and `strategy.ep` on the number of ranks a run will have, read as the run
builds its layout (raylane.loop.distributed.layout.Layout: a world they divide, replicas through
FSDP2, map-style data, a pipeline that gives a tp_plan, pp_stages or an ep_plan).
raylane.api.prepare_train calls `check_layout` beside raylane.prechecks' checks; each failure is
one ConfigError naming the field and the value; nothing here imports torch or Ray."""

from __future__ import annotations

import importlib.util

from raylane import pipelines_ref
from raylane.config import BaseConfig, ConfigError
from raylane.loop.distributed.layout import Layout, LayoutError


def check_layout(cfg: BaseConfig, world_size: int, world: str, pipeline: pipelines_ref.Resolved | None = None) -> None:
    """The layout `cfg` asks for on `world_size` ranks (`world`: where that number comes from, as
    the user set it), read as the run will build it (raylane.loop.distributed.layout.Layout):
    sizes the world divides, replicas only through FSDP2, map-style data, and a pipeline that
    gives a tp_plan, pp_stages or an ep_plan. The checks of the config alone are its validators'
    (raylane.config.base). `pipeline`: the config's, as the launch looked it up once
    (raylane.api.prepare_train; None: looked up here)."""
    s = cfg.strategy
    pipeline = pipeline or pipelines_ref.resolve(cfg.pipeline)
    layout = _asked(cfg, world_size, world)
    if s.expert_parallel:
        _check_expert_layout(cfg, world_size, world, pipeline)
    if layout is not None and layout.pp > 1:
        _check_pipeline_layout(cfg, layout, world_size, pipeline)
    if not s.tensor_parallel:
        return
    label = pipeline.label
    if layout is None or s.tp == "auto":  # any degree of the node's ranks may be chosen; none without a plan
        if pipeline.streams:
            raise ConfigError(
                f"strategy.tp = 'auto': the {label} pipeline streams its data (sources), split by rank, and the "
                "ranks of a tensor-parallel group must read the same batches; give strategy.tp: 1"
            )
        return
    tp, groups = layout.tp, layout.world_size // layout.tp  # DDP would hold a replica on each group
    if s.name == "ddp" and groups > 1:
        raise ConfigError(
            f"strategy.tp = {tp} with strategy.name = 'ddp' on {world_size} ranks: torch's DDP does not take "
            f"tensor-parallel weights, and replicas through FSDP2 are not built yet; use strategy.name: fsdp "
            f"(FSDP2 over the {groups} data-parallel ranks)"
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


def _asked(cfg: BaseConfig, world_size: int, world: str) -> Layout | None:
    """The layout the config fixes on `world_size` ranks where it lays the model out over more than
    the data-parallel ranks (tp, pp) or replicates FSDP2's shards (dp_replicate): None where each
    rank holds whole layers without replicas, or tp is chosen on the ranks (`tp: auto`, with no
    pp or replicas). ConfigError, one line naming the fields, where their sizes do not divide the
    world."""
    s = cfg.strategy
    try:
        if s.pp > 1 or s.tp_degree > 1:
            return Layout.model_parallel_of(s, world_size, world=world)
        if s.dp_replicate > 1:
            return Layout.data_parallel_of(s.name, world_size, replicas=s.dp_replicate, world=world)
    except LayoutError as exc:
        raise ConfigError(str(exc)) from None
    return None


def _check_pipeline_layout(cfg: BaseConfig, layout: Layout, world_size: int, pipeline: pipelines_ref.Resolved) -> None:
    """`strategy.pp` in `layout` on `world_size` ranks: data-parallel replicas of each stage
    through FSDP2, map-style data, and a pipeline that says how its model splits into stages."""
    s, pp = cfg.strategy, layout.pp
    label = pipeline.label
    replicas = layout.data_parallel
    if s.name == "ddp" and replicas > 1:
        raise ConfigError(
            f"strategy.pp = {pp} with strategy.name = 'ddp' on {world_size} ranks: the {replicas} data-parallel "
            "replicas of each stage are FSDP2's; use strategy.name: fsdp"
        )
    if pipeline.streams:
        raise ConfigError(
            f"strategy.pp = {pp}: the {label} pipeline streams its data (sources), split by rank, and the "
            "stages of a pipeline must read the same batches; pipeline parallelism needs a map-style dataset"
        )
    if cfg.gives_pp_stages() is False:
        raise ConfigError(
            f"strategy.pp = {pp}: the {label} pipeline gives no pp_stages (how its model splits into "
            "stages): give its Pipeline pp_stages='auto' or lists of module names (docs/strategies.md, Pipeline "
            "parallelism)"
        )


def _check_expert_layout(cfg: BaseConfig, world_size: int, world: str, pipeline: pipelines_ref.Resolved) -> None:
    """`strategy.ep` on `world_size` ranks: groups of ep data-parallel ranks that the world
    divides, what it does not combine with yet beyond the strategy section (whose own are its
    validators': raylane.config.strategy), and a pipeline that names its experts."""
    s, ep = cfg.strategy, cfg.strategy.ep
    refused = {
        "fault_tolerance.enabled": (
            cfg.fault_tolerance.enabled,
            "expert parallelism inside replica groups is not supported yet; use strategy.ep: 1, or no fault_tolerance",
        ),
        f"scaling.num_workers = {[cfg.scaling.min_workers, cfg.scaling.num_workers]}": (
            cfg.scaling.elastic,
            "elastic runs keep no expert-parallel layout yet; give one number of workers",
        ),
    }
    for key, (bad, why) in refused.items():
        if bad:
            raise ConfigError(f"{key} with strategy.ep = {ep!r}: {why}")
    if ep == "auto":  # any degree the ranks and the experts allow; 1 without a plan (expert_auto)
        return
    others = s.tp_degree * s.pp * s.cp
    data = world_size // others
    if data % ep:
        ranks = f"{data} data-parallel rank{'s' if data != 1 else ''}"
        where = world if others == 1 else f"{world} / (strategy.tp x strategy.pp x strategy.cp = {others})"
        raise ConfigError(
            f"strategy.ep = {ep}: does not divide the {ranks} of {where} (each group of ep of them holds one "
            "copy of the experts, split)"
        )
    if cfg.gives_ep_plan() is False:
        raise ConfigError(_no_ep_plan(ep, pipeline.label))


def _no_ep_plan(ep: int, label: str) -> str:
    return (
        f"strategy.ep = {ep}: the {label} pipeline gives no ep_plan (which modules are its experts): give its "
        "Pipeline an ep_plan (docs/strategies.md, Expert parallelism), or use strategy.ep: 1"
    )


def check_plan(cfg: BaseConfig, world_size: int) -> list[str]:
    """A model-parallel run's plan and stages on its model, as `raylane check --plan` shows them
    (raylane.loop.plan_view): the pipeline's build(cfg) run here with the model on the meta device,
    so that a rule naming no module, a style that is none, heads that tp does not divide, tied
    weights split apart, more stages than blocks, or an ep_plan naming no experts module is one
    ConfigError before any worker starts, for a user's pipeline as for a shipped one. Returns the
    lines to show when the model could not be looked at here (build() failing on this machine,
    which may lack what the ranks have: the run goes on, and says so). Nothing for a run without
    tp, pp or ep. The same in a process that
    trains next (a torchrun rank): the forward on a fake process group leaves it as it found it
    (raylane.loop.distributed.fake.fake_work)."""
    s = cfg.strategy
    if not (s.tensor_parallel or s.pp > 1 or s.expert_parallel):
        return []
    from raylane.loop.meta_build import Unchecked
    from raylane.loop.plan_view import pipeline_plan
    from raylane.pipelines_ref import UserCodeError

    what = "the expert plan is" if s.expert_parallel else "the plan and stages are"
    try:
        if s.expert_parallel:  # alone: tp and pp are refused beside it (raylane.config.strategy)
            _check_expert_plan(cfg)
        else:
            pipeline_plan(cfg, world_size)
    except Unchecked as exc:
        return [f"raylane: {what} not checked before launch: {exc}"]
    except UserCodeError as exc:
        if isinstance(exc.__cause__, ConfigError):  # build()'s own refusal of the config: the ranks' too
            raise ConfigError(str(exc.__cause__)) from None
        return [f"raylane: {what} not checked before launch: {exc}"]
    except ValueError as exc:  # one line naming the rule or the key (ConfigError's among them)
        raise ConfigError(str(exc)) from None
    return []


def _check_expert_plan(cfg: BaseConfig) -> None:
    """`strategy.ep` > 1: the pipeline's ep_plan names experts modules of its model (built on the
    meta device, raylane.loop.meta_build) that ep ranks can hold equal shares of. `auto`: a plan
    that names modules must name experts modules (a misspelt one is a mistake at any degree, found
    here rather than as ep 1 on the ranks); no plan, or an empty one (a dense model's), leaves
    the ranks to choose 1. ValueError."""
    from raylane.loop.distributed.expert_plan import resolve_ep_plan
    from raylane.loop.meta_build import build_for_checks

    ep = cfg.strategy.ep
    pipe = build_for_checks(cfg)
    plan = pipe.ep_plan
    if ep == "auto" and (plan is None or not (plan(pipe.model) if callable(plan) else plan)):
        return
    if plan is None:
        raise ConfigError(_no_ep_plan(cfg.strategy.ep_degree, pipelines_ref.label(cfg.pipeline)))
    try:
        resolve_ep_plan(pipe.model, plan, ep=None if ep == "auto" else ep)
    except ValueError as exc:
        raise ConfigError(f"strategy.ep = {ep!r}: {exc}") from None


def layout_world(cfg: BaseConfig) -> tuple[int, str]:
    """The ranks a Ray run's layout spans, and where that number comes from: a replica group's
    (fault_tolerance: each group lays the model out on its own workers), else the whole world."""
    world, ft = cfg.scaling.num_workers, cfg.fault_tolerance
    if not ft.enabled:
        return world, f"scaling.num_workers = {world}"
    size = ft.group_size(world)
    workers = f"{size} worker{'s' if size != 1 else ''}"
    return size, f"a replica group's {workers} (scaling.num_workers = {world} / fault_tolerance.replica_groups)"


def check_replica_groups(cfg: BaseConfig, in_process: str | None) -> None:
    """Replica groups where they can run: on Ray (`in_process`, None there: the one process of
    --local or torchrun's ranks, which no launcher restarts one group at a time), with torchft
    installed (looked up, not imported: the check stays fast). The rest is the config's own check
    (raylane.config.base)."""
    if not cfg.fault_tolerance.enabled:
        return
    if in_process is not None:
        raise ConfigError(
            f"fault_tolerance.enabled with {in_process}: replica groups need a launcher that restarts one group "
            "alone, which Ray is and torchrun and --local are not; run it on Ray"
        )
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "fault_tolerance.enabled: needs torchft, which is not installed here; "
            "pip install 'raylane[fault-tolerance]' (x86-64 Linux)"
        )
