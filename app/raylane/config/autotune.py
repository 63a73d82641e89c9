"""A pipeline config's optional `autotune:` section (`raylane autotune`'s search space: each knob
a list of values, narrowing raylane's defaults) and what follows from it without running
anything: the space checked against the config (`space`), the settings the search runs with and
a relaunch compares (`SearchSettings`, built by `settings`: the driver hands them to the ranks
as they are), and the winner as it trains (`winner_config`). How the search runs is
raylane.autotuning's. Nothing here imports torch or Ray."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raylane.config.base import BaseConfig
from raylane.config.batching import GlobalBatch, hold_global_batch
from raylane.config.load import (
    apply_overrides,
    apply_values,
    config_path,
    normalize_pipeline,
    read_config_file,
    read_yaml,
    validate,
    validate_section,
)
from raylane.config.sections import Section
from raylane.errors import ConfigError


class AutotuneSection(Section):
    """Each knob: the values to try (null: raylane's default for this machine). The config's own
    value of a knob is tried first."""

    strategies: list[Literal["ddp", "fsdp"]] | None = Field(
        None, description="Strategies to try. null: DDP and FSDP on more than one worker, else the config's."
    )
    batch_sizes: list[int] | None = Field(
        None,
        min_length=1,
        description="Micro-batches per worker to try (accumulation makes up the rest of the global batch). null: "
        "the powers of two that divide the per-worker share.",
    )
    global_batch: int | None = Field(
        None,
        ge=1,
        description="Samples per optimizer step, held by every candidate. null: the config's `train.global_batch`, "
        "else batch_size x grad_accum_steps x num_workers.",
    )
    precisions: list[Literal["fp32", "bf16", "fp16"]] | None = Field(
        None, description="`train.precision` values to try. null: fp32 and bf16."
    )
    activation_checkpointing: list[bool] | None = Field(
        None, description="`train.activation_checkpointing` values to try. null: false and true."
    )
    compile: list[bool] | None = Field(
        None, description="`train.compile` values to try. null: false and true on a GPU, false on CPU."
    )
    bucket_cap_mb: list[float] | None = Field(
        None, description="DDP's `strategy.bucket_cap_mb` values to try. null: the config's, 5 and 100."
    )
    reshard_after_forward: list[bool] | None = Field(
        None, description="FSDP's `strategy.reshard_after_forward` values to try. null: true and false."
    )
    comm_hooks: list[Literal["none", "fp16", "bf16", "powersgd"]] | None = Field(
        None, description="DDP's `strategy.comm_hook` values to try. null: none and bf16 on a GPU, none on CPU."
    )
    warmup_steps: int = Field(2, ge=1, le=1000, description="Steps per round before timing starts.")
    profile_steps: int = Field(
        10,
        ge=1,
        le=100_000,
        description="Steps timed per round, in `windows` windows: a candidate's figure is the median of the "
        "windows of all its rounds, with an interval.",
    )
    windows: int = Field(5, ge=2, le=1000, description="Windows a round's timed steps are split into.")
    min_window_s: float = Field(
        0.1, ge=0, le=60, description="A window lasts at least this long: tiny steps are measured over more of them."
    )
    min_rounds: int = Field(
        2,
        ge=1,
        le=100,
        description="Rounds (each a fresh build, at another moment) for the leader and the candidates simpler than it.",
    )
    max_rounds: int = Field(4, ge=1, le=100, description="Rounds at most for a candidate still tied with the leader.")
    max_candidates: int = Field(32, ge=1, le=1000, description="Candidates measured at most.")
    budget_s: float | None = Field(
        None, gt=0, description="Stop after this many seconds with the best so far (also `--budget-s`). null: no limit."
    )
    safety_margin: float = Field(
        0.1,
        ge=0,
        le=10,
        description="Added to the memory estimate before pruning a candidate (0.1: 10% more than estimated must fit).",
    )

    @model_validator(mode="after")
    def _rounds_and_windows(self) -> AutotuneSection:
        if self.profile_steps < self.windows:
            raise ValueError(
                f"autotune.profile_steps = {self.profile_steps}: fewer than autotune.windows = "
                f"{self.windows} (each window needs a step)"
            )
        if self.min_rounds > self.max_rounds:
            raise ValueError(
                f"autotune.min_rounds = {self.min_rounds}: more than autotune.max_rounds = {self.max_rounds}"
            )
        return self


def load(source: str, overrides: Iterable[str] = ()) -> tuple[AutotuneSection, BaseConfig]:
    """(the search settings, the validated base config); `--set autotune.x=...` sets the first."""
    raw = read_yaml(source)
    if "sweep" in raw:
        raise ConfigError(f"config file {source!r}: is a sweep file; autotune a pipeline config")
    overrides = list(overrides)
    raw = apply_overrides(raw, [o for o in overrides if o.strip().startswith("autotune.")])
    section = validate_section(AutotuneSection, raw.pop("autotune", None) or {}, "autotune", "autotune section")
    raw = apply_overrides(
        read_config_file(source, raw), [o for o in overrides if not o.strip().startswith("autotune.")]
    )
    return section, validate(normalize_pipeline(raw, config_path(source).resolve().parent))


def _searchable(cfg: BaseConfig) -> None:
    """The runs a search measures: one worker group, laid out data-parallel."""
    if cfg.fault_tolerance.enabled:
        raise ConfigError(
            "fault_tolerance.enabled: autotune measures one worker group; autotune without fault_tolerance and "
            "train the winner with it"
        )
    if cfg.strategy.tensor_parallel:
        raise ConfigError(
            f"strategy.tp = {cfg.strategy.tp!r}: autotune does not search tensor-parallel layouts yet; "
            "autotune with strategy.tp: 1"
        )
    if cfg.strategy.pp > 1:
        raise ConfigError(
            f"strategy.pp = {cfg.strategy.pp}: autotune does not search pipeline-parallel layouts yet; "
            "autotune with strategy.pp: 1"
        )


def space(section: AutotuneSection, cfg: BaseConfig) -> tuple[dict[str, list[Any]], GlobalBatch]:
    """Dotted key -> values, the config's own value first; and the global batch held. Checks
    every value against the config (ConfigError naming the field and the value)."""
    _searchable(cfg)
    t, s, workers = cfg.train, cfg.strategy, cfg.scaling.num_workers
    gpu = cfg.scaling.use_gpu
    if cfg.scaling.elastic:
        raise ConfigError(
            f"scaling.num_workers = {[cfg.scaling.min_workers, workers]}: autotune measures on a fixed "
            "number of workers; give one (the largest the run will have)"
        )
    size = section.global_batch or cfg.train.global_batch or t.batch_size * t.grad_accum_steps * workers
    if size % workers:
        raise ConfigError(f"autotune.global_batch = {size}: not a multiple of scaling.num_workers = {workers}")
    share = size // workers
    sizes = section.batch_sizes or [b for b in (2**i for i in range(21)) if b <= share and share % b == 0]
    for b in sizes:
        if share % b:
            raise ConfigError(
                f"autotune.batch_sizes = {section.batch_sizes}: {b} does not divide the "
                f"{share} samples each of {workers} workers takes per step (global batch {size})"
            )
    knobs: dict[str, list[Any]] = {
        "strategy.name": section.strategies or (["ddp", "fsdp"] if workers > 1 else [s.name]),
        "train.batch_size": sizes,
        "train.precision": section.precisions or ["fp32", "bf16"],
        "train.activation_checkpointing": section.activation_checkpointing or [False, True],
        "train.compile": section.compile or ([False, True] if gpu else [False]),
        "strategy.bucket_cap_mb": section.bucket_cap_mb or [s.bucket_cap_mb, 5.0, 100.0],
        "strategy.reshard_after_forward": section.reshard_after_forward or [True, False],
        "strategy.comm_hook": section.comm_hooks or (["none", "bf16"] if gpu else ["none"]),
    }
    if workers == 1:  # one process: no wrapping, so no wrapper's knobs
        for key in ("strategy.name", "strategy.bucket_cap_mb", "strategy.reshard_after_forward", "strategy.comm_hook"):
            knobs[key] = [cfg.flat()[key]]
    own = cfg.flat()
    out = {}
    for key, values in knobs.items():
        first = [own[key]] if own[key] in values else []
        out[key] = list(dict.fromkeys([*first, *values]))
    if "fsdp" in out["strategy.name"] and "fp16" in out["train.precision"]:
        out["train.precision"].remove("fp16")  # the gradient scaler does not shard (BaseConfig says so)
    held = GlobalBatch(size=size)
    for key, values in out.items():
        for value in values:
            try:
                hold_global_batch(apply_values(cfg, {key: value}), held, "autotune.global_batch")
            except ConfigError as exc:
                raise ConfigError(f"autotune: {key} = {value!r}: {exc}") from None
    return out, held


class SearchSettings(BaseModel):
    """What one search runs with, as the driver hands it to every rank (pickled on Ray): the space,
    the budget, and how each candidate is measured. Built by `settings`; a key it does not know
    is refused, never dropped."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    space: dict[str, list[Any]]  # dotted key -> the values to try, the config's own first
    own: dict[str, Any]  # the config's own value of each key (the simplest)
    global_batch: GlobalBatch  # held by every candidate
    warmup_steps: int
    profile_steps: int  # timed per round, in `windows` windows
    windows: int
    min_window_s: float
    min_rounds: int
    max_rounds: int
    max_candidates: int
    safety_margin: float  # added to a memory estimate before it prunes
    budget_s: float | None = None
    record: str | None = None  # the search's record (a relaunch replays it); None: not kept


def settings(section: AutotuneSection, cfg: BaseConfig, record: str | None) -> SearchSettings:
    """What the search runs with (the space, the config's own values of its knobs, the global
    batch held, the section's measuring settings) and `record`, the file a relaunch replays."""
    knobs, held = space(section, cfg)
    flat = cfg.flat()
    return SearchSettings(
        space=knobs,
        own={k: flat[k] for k in knobs},
        global_batch=held,
        warmup_steps=section.warmup_steps,
        profile_steps=section.profile_steps,
        windows=section.windows,
        min_window_s=section.min_window_s,
        min_rounds=section.min_rounds,
        max_rounds=section.max_rounds,
        max_candidates=section.max_candidates,
        budget_s=section.budget_s,
        safety_margin=section.safety_margin,
        record=record,
    )


def winner_config(cfg: BaseConfig, held: GlobalBatch, values: dict[str, Any]) -> BaseConfig:
    """The winner, as it trains: a train.global_batch of the config's own is kept (with the split
    the search measured), so that a resume on another world size holds it as before."""
    won = hold_global_batch(apply_values(cfg, values), held, "autotune.global_batch")
    if cfg.train.global_batch is None:
        return won
    return won.model_copy(
        update={
            "train": won.train.model_copy(update={"global_batch": held.size, "global_batch_adjust": "grad_accum_steps"})
        }
    )
