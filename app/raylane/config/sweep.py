"""A sweep file's schema, validated at the edge without Ray: a `sweep:` section (name, base config,
search space over dotted config keys, algorithm, scheduler, budget) and, beside it, overrides of
the base config. `--set sweep.num_samples=8` changes the sweep, any other `--set` the base config.

Every key of the space is checked against the base config with a value from its domain, so a
typo (`optim.lrr`) or an impossible range fails here with the key and the value named. What a
sweep leaves in its folder, and how it runs, is raylane.sweeps' and raylane.onray.tune's.
Nothing here imports torch or Ray."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raylane.config.base import BaseConfig
from raylane.config.batching import GlobalBatch, hold_global_batch
from raylane.config.load import (
    apply_overrides,
    apply_values,
    check_metric,
    config_path,
    read_config_file,
    read_yaml,
    validate,
    validate_section,
)
from raylane.config.sections import NAME_PATTERN, Section
from raylane.errors import ConfigError

DOMAINS = ("choice", "grid", "uniform", "loguniform", "randint")
# Throughput a trial reports at each epoch end (rank 0's, over that epoch's steps after warm-up)
# and at its end (over the run), beside its eval metrics; the better direction of each.
SPEED_METRICS = {
    "samples_per_s": "max",
    "tokens_per_s": "max",
    "mfu": "max",
    "step_time_s": "min",
    "peak_memory_bytes": "min",
}
TIME_TO_TARGET = "time_to_target_s"


class TimeTo(Section):
    """Seconds of training (rank 0's, from the first step) until an eval metric reaches a value."""

    metric: str = Field(min_length=1, description="An eval metric of the pipeline.")
    value: float = Field(description="The value the metric must reach.")
    mode: Literal["min", "max"] = Field(description="`max`: reached at >= value; `min`: at <= value.")


class ObjectiveSection(Section):
    """What a sweep ranks trials by, other than a metric's last value."""

    time_to: TimeTo = Field(
        description="Rank trials by the training seconds until `metric` reaches `value`: `{metric, value, mode}`."
    )


class SweepSection(Section):
    """A sweep file's `sweep:` section (`raylane tune`); the rest of the file overrides the base config for every
    trial."""

    name: str = Field(
        pattern=NAME_PATTERN,
        description="The sweep's identity: its folder is `<run.storage_path>/<name>`, and rerunning the same name "
        "with the same settings continues it.",
    )
    base: str = Field(
        min_length=1,
        description="The base pipeline config: a file (relative to the sweep file), or a shipped config's name.",
    )
    space: dict[str, dict[str, Any]] = Field(
        min_length=1,
        description="Dotted config key -> `{choice: [..]}`, `{grid: [..]}`, `{uniform: [lo, hi]}`, "
        "`{loguniform: [lo, hi]}` or `{randint: [lo, hi]}` (hi excluded). Every key and range is checked "
        "against the base config before anything starts.",
    )
    algorithm: Literal["random", "grid", "optuna"] = Field(
        "random", description="How trials' values are drawn: `grid` needs listed values (choice or grid)."
    )
    scheduler: Literal["fifo", "asha", "pbt"] = Field(
        "fifo",
        description="`fifo`: every trial runs to its end; `asha`: bad trials stop early; `pbt`: worse trials "
        "continue from better ones' checkpoints with perturbed values.",
    )
    num_samples: int = Field(
        1, ge=1, le=100_000, description="Trials to run (a grid's values are repeated this many times)."
    )
    max_concurrent_trials: int | None = Field(
        None, ge=1, le=10_000, description="Trials at once. null: as many as the cluster's CPUs (or GPUs) hold."
    )
    metric: str = Field(
        "loss",
        min_length=1,
        description="What ranks trials: an eval metric of the pipeline, or a throughput (`samples_per_s`, "
        "`tokens_per_s`, `mfu`, `step_time_s`, `peak_memory_bytes`).",
    )
    mode: Literal["min", "max"] = Field(
        "min", description="`min`: a lower metric is better; `max`: higher. Inferred for throughput metrics."
    )
    seed: int = Field(0, ge=0, lt=2**32, description="The search's seed: the same seed draws the same trials.")
    grace_period: int = Field(1, ge=1, description="ASHA: epochs before a trial may be stopped.")
    reduction_factor: float = Field(2.0, gt=1, description="ASHA: 1/factor of the trials is kept at each rung.")
    perturbation_interval: int = Field(1, ge=1, description="PBT: epochs between exploit/explore decisions.")
    pbt_synchronous: bool = Field(
        False,
        description="PBT: every trial waits at each perturbation until all have reached it (Ray's synchronous PBT): "
        "an exploit at every interval, at the cost of pausing fast trials.",
    )
    objective: ObjectiveSection | None = Field(
        None,
        description="Rank trials by the time they take to reach an eval metric's value (`sweep.metric` is then "
        "`time_to_target_s`, mode min); a trial that never reaches it ranks last.",
    )
    global_batch: GlobalBatch | None = Field(
        None,
        description="Hold the global batch fixed over a space of batch sizes, accumulation or workers: "
        "`{size, adjust}`.",
    )

    @model_validator(mode="after")
    def _direction(self) -> SweepSection:
        given = self.model_fields_set
        if self.objective is not None:
            if "metric" in given and self.metric != TIME_TO_TARGET:
                raise ValueError(
                    f"sweep.metric = {self.metric!r} with sweep.objective: a time-to-target sweep "
                    f"ranks by {TIME_TO_TARGET} (set sweep.metric: {TIME_TO_TARGET}, or leave it out)"
                )
            self.__dict__.update(metric=TIME_TO_TARGET, mode="min")  # no re-validation of the model
        better = SPEED_METRICS.get(self.metric) or ("min" if self.metric == TIME_TO_TARGET else None)
        if better and "mode" not in given:
            self.__dict__["mode"] = better
        elif better and self.mode != better:
            raise ValueError(
                f"sweep.mode = {self.mode!r}: {self.metric} is better "
                f"{'higher' if better == 'max' else 'lower'} (use sweep.mode: {better})"
            )
        return self

    @field_validator("space")
    @classmethod
    def _domains(cls, space: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for key, domain in space.items():
            where = f"sweep.space.{key}"
            if not isinstance(domain, dict) or len(domain) != 1 or next(iter(domain)) not in DOMAINS:
                raise ValueError(f"{where} = {domain!r}: expected one of {{{' | '.join(DOMAINS)}: ...}}")
            kind, args = next(iter(domain.items()))
            if kind in ("choice", "grid"):
                if not isinstance(args, list) or not args:
                    raise ValueError(f"{where}.{kind} = {args!r}: expected a non-empty list")
                continue
            if not (isinstance(args, list) and len(args) == 2 and all(isinstance(a, (int, float)) for a in args)):
                raise ValueError(f"{where}.{kind} = {args!r}: expected [low, high]")
            low, high = args
            if not (math.isfinite(low) and math.isfinite(high) and low < high):
                raise ValueError(f"{where}.{kind} = {args!r}: needs low < high")
            if kind == "loguniform" and low <= 0:
                raise ValueError(f"{where}.loguniform = {args!r}: needs low > 0")
            if kind == "randint" and not all(isinstance(a, int) for a in args):
                raise ValueError(f"{where}.randint = {args!r}: needs integers")
        return space

    @model_validator(mode="after")
    def _grid_only(self) -> SweepSection:
        if self.algorithm == "grid":
            bad = [k for k, d in self.space.items() if next(iter(d)) not in ("choice", "grid")]
            if bad:
                raise ValueError(f"sweep.algorithm = 'grid' needs listed values: sweep.space.{bad[0]} is a range")
        if self.algorithm == "optuna":  # Ray's Optuna search refuses a grid once the sweep has started
            bad = [k for k, d in self.space.items() if next(iter(d)) == "grid"]
            if bad:
                raise ValueError(
                    f"sweep.algorithm = 'optuna' draws its own values: sweep.space.{bad[0]} is a grid "
                    "(use choice, or sweep.algorithm: grid)"
                )
        return self


def representative(domain: dict[str, Any]) -> list[Any]:
    """Values a domain can take, to check against the base config: every listed value, or the
    ends of a range."""
    kind, args = next(iter(domain.items()))
    if kind in ("choice", "grid"):
        return list(args)
    if kind == "randint":
        return [args[0], args[1] - 1]
    return list(args)


def load_sweep(path: str, overrides: Iterable[str] = ()) -> tuple[SweepSection, BaseConfig]:
    """(the sweep, its validated base config with the file's and --set overrides applied)."""
    raw = read_yaml(path)
    sweep_sets = [o for o in overrides if o.strip().startswith("sweep.")]
    base_sets = [o for o in overrides if not o.strip().startswith("sweep.")]
    raw = apply_overrides(raw, sweep_sets)
    if not isinstance(raw.get("sweep"), dict):
        if "pipeline" in raw:
            raise ConfigError(
                f"sweep file {str(path)!r}: is a pipeline config (no `sweep:` section): train it "
                f"with `raylane train {path}`, or sweep it from a sweep file whose `sweep.base` "
                "names it (e.g. pipelines/digits-sweep.yaml)"
            )
        raise ConfigError(f"sweep file {str(path)!r}: needs a `sweep:` section")
    sweep = validate_section(SweepSection, raw.pop("sweep"), "sweep", "sweep")
    # Relative paths are the sweep file's: `base:` (else from the working directory), and the
    # `pipeline:` of each file from that file's directory.
    sweep_dir = config_path(path).resolve().parent
    base_file = str(sweep_dir / sweep.base) if (sweep_dir / sweep.base).is_file() else sweep.base
    base_raw = read_config_file(base_file)
    # The sweep file's own sections override the base config's.
    _merge(base_raw, read_config_file(path, raw, pipeline=base_raw.get("pipeline")))
    base = validate(apply_overrides(base_raw, base_sets))
    for key, domain in sweep.space.items():
        for value in representative(domain):
            try:
                trial_config(base, {key: value})
            except ConfigError as exc:
                raise ConfigError(f"sweep.space.{key}: {exc}") from None
    _check_global_batch(sweep, base)
    _check_metric(sweep, base)
    return sweep, base


def _check_metric(sweep: SweepSection, base: BaseConfig) -> None:
    if base.train.early_stopping is not None:
        check_metric("train.early_stopping.metric", base.train.early_stopping.metric, base)
    if sweep.objective is not None:
        check_metric("sweep.objective.time_to.metric", sweep.objective.time_to.metric, base)
    elif sweep.metric == "mfu" and not (base.scaling.use_gpu or base.scaling.peak_tflops):
        raise ConfigError("sweep.metric = 'mfu': on CPU, MFU needs the device's peak: set scaling.peak_tflops")
    elif sweep.metric not in SPEED_METRICS:
        check_metric("sweep.metric", sweep.metric, base)


def _check_global_batch(sweep: SweepSection, base: BaseConfig) -> None:
    """Every listed combination of the keys that split the global batch divides it."""
    if sweep.global_batch is None:
        return
    keys = [k for k in ("train.batch_size", "train.grad_accum_steps", "scaling.num_workers") if k in sweep.space]
    for key in keys:
        if next(iter(sweep.space[key])) in ("uniform", "loguniform"):
            raise ConfigError(
                f"sweep.space.{key}: a continuous range with sweep.global_batch; list the values "
                "(choice, grid) or use randint"
            )
    for values in itertools.product(*(_every_value(sweep.space[k]) for k in keys)):
        params = dict(zip(keys, values, strict=True))
        try:
            trial_config(base, params, sweep.global_batch)
        except ConfigError as exc:
            where = ", ".join(f"{k} = {v!r}" for k, v in params.items()) or "the base config"
            raise ConfigError(f"{exc} (with {where})") from None


def _every_value(domain: dict[str, Any]) -> list[Any]:
    """Every value a discrete domain can take (a randint range in full)."""
    kind, args = next(iter(domain.items()))
    return list(range(args[0], args[1])) if kind == "randint" else representative(domain)


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def trial_config(base: BaseConfig, params: dict[str, Any], global_batch: GlobalBatch | None = None) -> BaseConfig:
    """The base config with one trial's values at their dotted keys, validated; with
    `global_batch`, its `adjust` key then set to hold it."""
    return hold_global_batch(apply_values(base, params), global_batch, "sweep.global_batch.size")


def is_sweep_file(config: Any) -> bool:
    """A config file with a `sweep:` section (`raylane tune`'s), which `raylane check` also takes."""
    return isinstance(config, (str, Path)) and isinstance(read_yaml(config).get("sweep"), dict)


def check_sweep_layout(sweep: SweepSection, base: BaseConfig) -> None:
    """Sweeps train data-parallel trials only, for now: each trial's layout is not checked."""
    swept = [k for k in sweep.space if k in ("strategy.tp", "strategy.sequence_parallel", "strategy.pp")]
    if base.fault_tolerance.enabled or any(k.startswith("fault_tolerance.") for k in sweep.space):
        raise ConfigError(
            "fault_tolerance.enabled: sweeps of replica-group runs are not built yet (a trial that loses a worker "
            "restarts whole); sweep without fault_tolerance"
        )
    if base.strategy.pp > 1:
        raise ConfigError(
            f"strategy.pp = {base.strategy.pp}: sweeps of pipeline-parallel runs are not built yet; sweep with "
            "strategy.pp: 1"
        )
    if swept or base.strategy.tensor_parallel:
        key = f"sweep.space.{swept[0]}" if swept else f"strategy.tp = {base.strategy.tp!r}"
        raise ConfigError(f"{key}: sweeps of tensor-parallel runs are not built yet; sweep with strategy.tp: 1")
