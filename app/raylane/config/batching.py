"""The global batch (samples per optimizer step = batch_size x grad_accum_steps x workers), held
fixed while the number of workers changes (an elastic run's sizes) or a search changes how it is
split (sweeps, autotune): each such config trains the same model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError

from raylane.config.sections import Section, TrainSection
from raylane.errors import ConfigError

if TYPE_CHECKING:
    from raylane.config.base import BaseConfig


def held_batch(cfg: BaseConfig, workers: int) -> BaseConfig:
    """`cfg` with train.global_batch held on `workers` ranks (unchanged when it is unset and the
    run is not elastic; an elastic run holds batch_size x grad_accum_steps x the most workers).
    The ranks of a tensor-parallel group, and of a pipeline, read the same batches: the batch splits
    over workers / (tp x pp)."""
    t = cfg.train
    size = effective_global_batch(cfg)
    if size != t.global_batch:
        cfg = cfg.model_copy(update={"train": t.model_copy(update={"global_batch": size})})
    if size is None:
        return cfg
    held = GlobalBatch(size=size, adjust=t.global_batch_adjust)
    return hold_global_batch(cfg, held, "train.global_batch", workers // (cfg.strategy.tp_degree * cfg.strategy.pp))


@dataclass(frozen=True)
class HeldBatch:
    """train.global_batch held once, before the launch, on the world the run is planned for
    (`workers` ranks): the train section the ranks train with, as JSON (a pipeline's own config
    class reads it back where the ranks validate theirs). Only that section is held: the config
    MLflow records is the one given."""

    workers: int
    train: dict[str, Any]

    @classmethod
    def of(cls, cfg: BaseConfig, workers: int) -> HeldBatch:
        """ConfigError, as held_batch, when the batch does not split over `workers`."""
        return cls(workers, held_batch(cfg, workers).train.model_dump(mode="json"))


def held_for(cfg: BaseConfig, workers: int, held: HeldBatch | None) -> BaseConfig:
    """`cfg` held on `workers` ranks: the section handed down when it was held on as many, else
    (an elastic run's other size, a launch that held nothing) held here."""
    if held is not None and held.workers == workers:
        return cfg.model_copy(update={"train": type(cfg.train).model_validate(held.train)})
    return held_batch(cfg, workers)


def effective_global_batch(cfg: BaseConfig) -> int | None:
    """train.global_batch, or for an elastic run without one, batch_size x grad_accum_steps x max."""
    t = cfg.train
    if t.global_batch is None and cfg.scaling.elastic:
        return t.batch_size * t.grad_accum_steps * cfg.scaling.num_workers
    return t.global_batch


def world_sizes(cfg: BaseConfig) -> list[int]:
    """The numbers of workers a Ray run may have: num_workers, or for an elastic run each size
    from min to max that splits its global batch (Ray's policy is kept to these: see
    raylane.onray.elastic). ConfigError, naming the size, when min or max does not split it."""
    s = cfg.scaling
    held_batch(cfg, s.num_workers)
    low = s.min_workers
    if not s.elastic or low is None:  # an elastic run has its min_workers
        return [s.num_workers]
    held_batch(cfg, low)
    sizes = [low]
    for workers in range(low + 1, s.num_workers + 1):
        try:
            held_batch(cfg, workers)
        except ConfigError:
            continue
        sizes.append(workers)
    return sizes


class GlobalBatch(Section):
    """A global batch held fixed while a search changes how it is split (sweeps, autotune):
    samples per optimizer step = batch_size x grad_accum_steps x num_workers. `adjust` names the
    quantity computed from the others, so every candidate trains the same model."""

    size: int = Field(ge=1, le=1_000_000_000, description="Samples per optimizer step, held by every trial.")
    adjust: Literal["grad_accum_steps", "batch_size"] = Field(
        "grad_accum_steps",
        description="The key computed from the others (batch_size x grad_accum_steps x num_workers = size); a "
        "combination that does not divide it exits 2 before anything starts.",
    )


def hold_global_batch(cfg: BaseConfig, held: GlobalBatch | None, field: str, workers: int | None = None) -> BaseConfig:
    """`cfg` with `held.adjust` set so that its global batch is `held.size` on `workers` ranks
    (default scaling.num_workers); ConfigError (naming `field` and the values) when the others
    do not divide it."""
    if held is None:
        return cfg
    given = workers is not None
    t, workers = cfg.train, workers or cfg.scaling.num_workers
    other = t.batch_size if held.adjust == "grad_accum_steps" else t.grad_accum_steps
    share, rest = divmod(held.size, other * workers)
    if rest or share < 1:
        fixed = (
            f"train.batch_size = {t.batch_size}"
            if held.adjust == "grad_accum_steps"
            else f"train.grad_accum_steps = {t.grad_accum_steps}"
        )
        # With tensor (or pipeline) parallelism, `workers` are the data-parallel ranks (held_batch).
        group = cfg.strategy.tp_degree * cfg.strategy.pp if given else 1
        ranks = f"scaling.num_workers = {workers}"
        if group > 1:
            ranks = f"{workers} data-parallel ranks ({workers * group} ranks in model-parallel groups of {group})"
        raise ConfigError(
            f"{field} = {held.size}: not a multiple of {fixed} x {ranks}, so train.{held.adjust} cannot hold it"
        )
    try:
        train = TrainSection.model_validate({**t.model_dump(), held.adjust: share})
    except ValidationError:
        raise ConfigError(f"{field} = {held.size}: needs train.{held.adjust} = {share}, out of its range") from None
    return cfg.model_copy(update={"train": train})


def skipped_sizes(cfg: BaseConfig, sizes: list[int]) -> list[str]:
    """An elastic run skips the sizes between min and max that do not split its global batch."""
    skipped = sorted(set(range(sizes[0], sizes[-1] + 1)) - set(sizes))
    if not (skipped and cfg.scaling.elastic):
        return []
    shown = ", ".join(map(str, skipped[:8])) + (", ..." if len(skipped) > 8 else "")
    line = (
        f"raylane: elastic run on {', '.join(map(str, sizes[:8]))}{', ...' if len(sizes) > 8 else ''} "
        f"workers: {shown} would not split the global batch, so it runs on the next size down"
    )
    return [line]
