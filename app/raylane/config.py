"""The one typed config tree: YAML plus `--set dotted.key=value`, validated once at the edge.

Every user-facing mistake becomes a `ConfigError` whose message names the dotted field and the
bad value; the CLI turns it into exit code 2. Nothing here imports torch or Ray, so a bad config
is rejected before either starts.
"""

from __future__ import annotations

import copy
import datetime as _dt
import difflib
import importlib
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raylane import paths, pipelines_ref
from raylane.errors import ConfigError
from raylane.paths import InputPath, OutputPath

# Shipped pipeline name -> module. A config may also name a dotted module or a .py file of the
# user's own (raylane.pipelines_ref).
PIPELINES: dict[str, str] = pipelines_ref.SHIPPED

_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean X?)` for the closest of `choices`, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


class RunSection(Section):
    # A run's identity: relaunching the same name resumes it (checkpoints and MLflow run).
    name: str | None = Field(None, pattern=_NAME_PATTERN)
    # Relative: to the working directory, beside MLflow's default store (raylane.paths).
    storage_path: OutputPath = Field("runs", min_length=1)


class ScalingSection(Section):
    # An int, or [min, max] (`--set scaling.num_workers=1,2`): an elastic run on Ray starts once
    # `min` workers fit, grows to `max` as nodes join and shrinks to the survivors when one is
    # lost, holding train.global_batch (by default batch_size x grad_accum_steps x max).
    num_workers: int = Field(1, ge=1, le=4096)
    min_workers: int | None = Field(None, ge=1, le=4096)
    # Elastic: how often a healthy group checks whether more workers fit now.
    resize_check_s: float = Field(60.0, gt=0, le=86_400)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1.0, gt=0, le=1024)
    # With use_gpu: a fraction packs several small Tune trials onto one GPU (one worker each:
    # NCCL cannot run two ranks of one group on the same GPU).
    gpus_per_worker: float = Field(1.0, gt=0, le=64)
    @model_validator(mode="before")
    @classmethod
    def _range(cls, data: Any) -> Any:
        """`num_workers: [min, max]` (or "min,max" from --set) is min_workers and num_workers."""
        if not isinstance(data, dict):
            return data
        value = data.get("num_workers")
        if isinstance(value, str) and "," in value:
            value = [v.strip() for v in value.split(",")]
        if isinstance(value, (list, tuple)):
            if len(value) != 2:
                raise ValueError(f"scaling.num_workers = {value!r}: expected a number or [min, max]")
            try:
                low, high = (int(v) for v in value)
            except (TypeError, ValueError):
                raise ValueError(f"scaling.num_workers = {value!r}: expected a number or [min, max]") from None
            if not 1 <= low <= high:
                raise ValueError(f"scaling.num_workers = {value!r}: needs 1 <= min <= max")
            data = {**data, "min_workers": low, "num_workers": high}
        return data

    @model_validator(mode="after")
    def _min_at_most_max(self) -> ScalingSection:
        if self.min_workers is not None and self.min_workers > self.num_workers:
            raise ValueError(f"scaling.min_workers = {self.min_workers}: more than scaling.num_workers = "
                             f"{self.num_workers}")
        return self

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers

    # Memory of one device, for strategy.name: auto; null detects it (GPU memory, or this host's
    # RAM shared by its ranks on CPU).
    device_memory_gb: float | None = Field(None, gt=0, le=1_000_000)
    # Dense peak FLOP/s of one device at train.precision, for MFU; null looks the GPU up in a
    # table (raylane.loop.devices). No MFU on CPU unless given.
    peak_tflops: float | None = Field(None, gt=0, le=1_000_000)


class StrategySection(Section):
    # ddp: a full replica per rank. fsdp: FSDP2, parameters, gradients and optimizer state
    # sharded (HSDP across nodes). auto: estimate memory, DDP when it fits with margin.
    name: Literal["ddp", "fsdp", "auto"] = "ddp"
    # FSDP: free the gathered parameters after each block's forward (less memory, one more
    # all-gather in backward).
    reshard_after_forward: bool = True
    # FSDP: keep sharded parameters, gradients and optimizer state in host memory.
    cpu_offload: bool = False
    # DDP, from the PyTorch DDP paper: gradient bucket size, buckets as gradient views (saves one
    # copy of the gradients), a graph that never changes between steps, unused parameters.
    bucket_cap_mb: float = Field(25.0, gt=0, le=100_000)
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    find_unused_parameters: bool = False
    # DDP: compress gradients before the all-reduce.
    comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: int = Field(1, ge=1, le=1024)


class EarlyStoppingSection(Section):
    # A held-out metric, named as checkpoint.best_metric names it (`loss`; `val/loss` for a
    # named held-out set). The run ends FINISHED, with a checkpoint, once `patience`
    # evaluations in a row have not improved on the best by more than `min_delta`.
    metric: str = Field("loss", min_length=1)
    mode: Literal["min", "max"] = "min"
    patience: int = Field(3, ge=1, le=1_000_000)
    min_delta: float = Field(0.0, ge=0)


class TrainSection(Section):
    max_epochs: int = Field(1, ge=1, le=1_000_000)
    max_steps: int | None = Field(None, ge=1)
    batch_size: int = Field(32, ge=1, le=1_000_000, description="samples per worker per step")
    seed: int = Field(0, ge=0, lt=2**32)
    # A non-finite loss or gradient: stop with an error naming the step, or skip that update.
    on_nan: Literal["stop", "skip"] = "stop"
    # Micro-batches of batch_size per optimizer step; gradients are reduced on the last only.
    grad_accum_steps: int = Field(1, ge=1, le=65_536)
    # Autocast (DDP, one process) or FSDP's parameter dtype; fp16 adds a gradient scaler.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Clip the global gradient norm (over all shards) to this value; null: no clipping.
    grad_clip_norm: float | None = Field(None, gt=0)
    # Recompute each block's activations in backward instead of keeping them.
    activation_checkpointing: bool = False
    # torch.compile each block (or the whole model when it has no blocks).
    compile: bool = False
    # Evaluate on the held-out set every N epochs; 0: only at the end of the run (which always
    # has an evaluation).
    eval_every_n_epochs: int = Field(1, ge=0)
    # Also every N optimizer steps (0: off), for runs of few, long epochs; an epoch end that is
    # also such a step is evaluated once. A checkpoint due at that step carries the metrics.
    eval_every_n_steps: int = Field(0, ge=0)
    # Stop when a held-out metric stops improving (null: off): see EarlyStoppingSection.
    early_stopping: EarlyStoppingSection | None = None
    # Samples per optimizer step, held at any number of workers: global_batch_adjust is computed
    # from the others, and each epoch is one permutation of the samples taken a step at a time,
    # so a checkpoint resumed on another world size continues the same epoch at the same sample
    # (none skipped or repeated). null: batch_size x grad_accum_steps x workers, and each
    # rank's own shard of the epoch (a resume on another world size restarts the epoch).
    global_batch: int | None = Field(None, ge=1, le=1_000_000_000)
    global_batch_adjust: Literal["grad_accum_steps", "batch_size"] = "grad_accum_steps"

    @model_validator(mode="after")
    def _early_stopping_needs_evaluations(self) -> TrainSection:
        if self.early_stopping is not None and not (self.eval_every_n_epochs or self.eval_every_n_steps):
            raise ValueError(f"train.early_stopping.metric = {self.early_stopping.metric!r}: early stopping counts "
                             "evaluations, and train.eval_every_n_epochs and train.eval_every_n_steps are both 0 "
                             "(the run would never stop early); set one of them")
        return self


class LoaderSection(Section):
    """The DataLoader of a map-style dataset (a FileSource streams its own batches)."""

    # Processes loading batches beside each rank. 0: in the rank's own process, as the HF Trainer
    # and Accelerate default to (in-memory tensors gain nothing from workers, which only add
    # start-up time). auto: min(4, this rank's share of the host's cores - 1) on a GPU, 0 on CPU,
    # where the rank's compute already uses the cores.
    num_workers: int | Literal["auto"] = 0
    # Batches in page-locked memory, copied to the GPU without blocking. null: true on a GPU.
    pin_memory: bool | None = None
    # Keep the workers between epochs (and evaluations). null: true when there are workers.
    persistent_workers: bool | None = None
    # Batches each worker loads ahead. null: torch's default (2); needs workers.
    prefetch_factor: int | None = Field(None, ge=1, le=1024)

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 256):
            return value
        raise ValueError(f"loader.num_workers = {_short(value)}: expected a number of workers from 0 to 256, or auto")

    @model_validator(mode="after")
    def _needs_workers(self) -> LoaderSection:
        if self.num_workers == 0:
            for key in ("prefetch_factor", "persistent_workers"):
                if getattr(self, key):
                    raise ValueError(f"loader.{key} = {getattr(self, key)}: needs loader.num_workers > 0 "
                                     "(it sets the worker processes, and there are none)")
        return self


class OptimSection(Section):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(1e-3, gt=0, le=10)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=1)
    # With weight_decay: decay biases and normalization weights too. false (the default): no decay
    # on 1-D parameters and on any parameter of a norm layer (LayerNorm, RMSNorm, BatchNorm, ...).
    decay_norm_and_bias: bool = False
    # A linear warmup over warmup_steps (from lr/warmup_steps to lr), then: constant; cosine or
    # linear decay to lr x min_lr_ratio at the last step; or wsd (warmup-stable-decay): lr held,
    # then a linear decay to lr x min_lr_ratio over the last decay_fraction of the steps (starting
    # no earlier than the warmup's end: a run too short for both says so and shortens the decay).
    # The last step follows train.max_steps / max_epochs, on a relaunch too.
    schedule: Literal["constant", "cosine", "linear", "wsd"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    decay_fraction: float = Field(0.2, gt=0, le=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class CheckpointSection(Section):
    # 0 means only at the end of each epoch.
    every_n_steps: int = Field(0, ge=0)
    # Also at the end of every N epochs; 0: not at epoch ends. The end of the run, and a stop
    # (preemption), always checkpoint.
    every_n_epochs: int = Field(1, ge=0)
    # Keep only the newest N committed checkpoints (plus, with keep_best, the N best by
    # best_metric, measured at epoch ends); null keeps all. 3, not all: a 40-epoch run would
    # otherwise leave 50 folders, and resume only needs the latest (the others cover a bad one).
    keep: int | None = Field(3, ge=1)
    keep_best: int | None = Field(None, ge=1)
    best_metric: str = Field("loss", min_length=1)
    best_mode: Literal["min", "max"] = "min"
    # Only a copy of the state is taken between two steps; the files, their checksums and the
    # commit (agreed by every rank) are done on a background thread while training goes on.
    # false: the whole save and commit on the training thread.
    async_save: bool = True
    # A save that fails (disk full, I/O error): fail the run, or warn and train on.
    on_error: Literal["fail", "warn"] = "fail"
    # Start from this checkpoint (weights, optimizer, step) when the run has none of its own:
    # fine-tuning, or PBT continuing another trial's state. A local or shared path.
    init_from: InputPath | None = None


class FailureSection(Section):
    # Worker-group restarts (from the latest committed checkpoint) before the run fails; -1: no limit.
    max_failures: int = Field(0, ge=-1)


class DistSection(Section):
    # A rank stuck in a collective fails the run after this long (Ray's default is 1800 s).
    timeout_s: float = Field(300.0, gt=0, le=86_400)


class MlflowSection(Section):
    # Off: no MLflow run at all (benchmarks, quick experiments); the summary still has the results.
    enabled: bool = True
    experiment: str = Field("raylane", min_length=1, max_length=256)
    log_every_n_steps: int = Field(10, ge=1)
    # Checkpoints are recorded on the run by location (`uri`), or copied as artifacts.
    log_checkpoints: Literal["uri", "artifacts"] = "uri"
    # At the end of a finished run: the final model as an MLflow PyTorch model, and plots.
    log_model: bool = True
    # CPU, memory (and GPU) of rank 0's node, through MLflow's system metrics.
    system_metrics: bool = True
    system_metrics_interval_s: float = Field(10.0, ge=1, le=3600)


def apply_values(cfg: BaseConfig, values: Mapping[str, Any]) -> BaseConfig:
    """`cfg` with `values` at their dotted keys, validated (a sweep's trial, an autotune candidate)."""
    known = cfg.flat()
    for key in values:
        if key not in known:
            raise ConfigError(f"{key}: not a key of the {cfg.pipeline} config{did_you_mean(key, known)}")
    raw = cfg.model_dump(mode="json")
    for key, value in values.items():
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = value
    return validate(raw)


class BaseConfig(Section):
    """Sections shared by every pipeline; each pipeline adds its own `model` section."""

    pipeline: str
    run: RunSection = RunSection()
    scaling: ScalingSection = ScalingSection()
    strategy: StrategySection = StrategySection()
    train: TrainSection = TrainSection()
    optim: OptimSection = OptimSection()
    loader: LoaderSection = LoaderSection()
    checkpoint: CheckpointSection = CheckpointSection()
    failure: FailureSection = FailureSection()
    dist: DistSection = DistSection()
    mlflow: MlflowSection = MlflowSection()

    @model_validator(mode="after")
    def _compatible(self) -> BaseConfig:
        if self.train.precision == "fp16" and self.strategy.name != "ddp":
            raise ValueError(f"train.precision = 'fp16' with strategy.name = {self.strategy.name!r}: "
                             "the gradient scaler does not handle sharded gradients; use bf16")
        if self.strategy.comm_hook == "bf16" and not self.scaling.use_gpu:
            raise ValueError("strategy.comm_hook = 'bf16' needs scaling.use_gpu: true (NCCL); on CPU use fp16")
        if self.strategy.cpu_offload and (self.strategy.name == "ddp" or not self.scaling.use_gpu):
            raise ValueError("strategy.cpu_offload = True needs strategy.name: fsdp or auto, "
                             "and scaling.use_gpu: true (on CPU there is nothing to offload to)")
        if self.loader.pin_memory and not self.scaling.use_gpu:
            raise ValueError("loader.pin_memory = True needs scaling.use_gpu: true (pinned memory speeds up copies "
                             "to a GPU; on CPU there are none)")
        return self

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
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def config_class(pipeline: Any) -> type[BaseConfig]:
    """The `Config` of a pipeline reference (see raylane.pipelines_ref); relative references are
    looked up from the working directory."""
    return pipeline_config(pipelines_ref.normalize(pipeline, [Path.cwd()]))


def pipeline_config(ref: str) -> type[BaseConfig]:
    """The `Config` class of a normalized pipeline reference, checked to be a BaseConfig."""
    config = pipelines_ref.load(ref).Config
    if not (isinstance(config, type) and issubclass(config, BaseConfig)):
        raise ConfigError(f"pipeline = {ref!r}: Config is {config!r}, not a subclass of raylane.BaseConfig "
                          f"({pipelines_ref.CONTRACT})")
    return config


def config_path(path: str | Path) -> Path:
    """The file a config argument names: the path itself, or for a bare name (`digits`,
    `gpt-tiny`) that is not a file here, the YAML shipped in `pipelines/`."""
    p = Path(path)
    shipped = Path(importlib.import_module("raylane.pipelines").__file__).parent / f"{path}.yaml"
    if not p.exists() and re.fullmatch(r"[A-Za-z0-9_-]+", str(path)) and shipped.exists():
        return shipped
    return p


def normalize_pipeline(raw: dict[str, Any], config_dir: Path) -> dict[str, Any]:
    """`raw` with its `pipeline:` resolved from the config file's directory, then the working
    directory (a relative file becomes an absolute path)."""
    if "pipeline" in raw:
        raw["pipeline"] = pipelines_ref.normalize(raw["pipeline"], [config_dir, Path.cwd()])
    return raw


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a config file with `yaml.safe_load` (see `config_path` for bare names)."""
    p = config_path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(_not_found(str(path))) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r}: cannot read it ({exc.__class__.__name__})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise ConfigError(f"config file {str(path)!r}: invalid YAML{at}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r}: top level must be a mapping, got {_short(data)}")
    return data


def shipped_configs() -> list[str]:
    """The names `raylane train NAME` finds in `pipelines/` (digits, digits-sweep, gpt-tiny, ...)."""
    folder = Path(importlib.import_module("raylane.pipelines").__file__).parent
    return sorted(p.stem for p in folder.glob("*.yaml"))


def _not_found(path: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", path):
        return f"config file {path!r}: no such file"
    shipped = shipped_configs()
    hint = did_you_mean(path, shipped)
    return (f"config = {path!r}: no such file, and no shipped config of that name{hint}; "
            f"shipped: {', '.join(shipped)}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value); the value is read as YAML (numbers, bools, null, lists)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not _KEY_RE.match(key):
        raise ConfigError(f"--set {text!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        value = raw  # not YAML: keep it as the string the user typed
    # YAML 1.1 reads 1e-3 as a string; users mean a number.
    if isinstance(value, str):
        value = _maybe_float(value)
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for i, part in enumerate(path[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(path[: i + 1])
                raise ConfigError(f"--set {text!r}: {where} is {_short(child)}, not a section")
            node = child
        node[path[-1]] = value
    return raw


def validate(raw: Mapping[str, Any], *, outputs: bool = True) -> BaseConfig:
    """A config as read (a mapping) -> the validated config, its relative paths (those still
    relative: `--set` values, a mapping's, defaults) made absolute from the working directory.
    `outputs=False`: outputs (run.storage_path) are left as written, for a job that resolves them
    where it runs (raylane.onray.jobs)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: top level must be a mapping, got {_short(raw)}")
    raw = dict(raw)
    raw["pipeline"] = pipelines_ref.normalize(raw.get("pipeline"), [Path.cwd()])
    cls = pipeline_config(raw["pipeline"])
    raw = paths.resolve(raw, cls, Path.cwd(), inputs_only=not outputs, defaults=outputs)
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, cls)) from None


def read_config_file(source: str | Path, raw: dict[str, Any] | None = None,
                     pipeline: str | None = None) -> dict[str, Any]:
    """A config file as read (`raw`, when it was read already): its `pipeline:` and its input
    paths (those of `pipeline`'s Config when the file names none: a sweep file's overrides)
    resolved from the file's folder, or from the working directory for a shipped config, which
    is a template however it is named; not validated."""
    raw = read_yaml(source) if raw is None else raw
    folder = config_path(source).resolve().parent
    raw = normalize_pipeline(raw, folder)
    ref = raw.get("pipeline") or pipeline
    try:
        cls = pipeline_config(ref) if isinstance(ref, str) else None
    except ConfigError:
        cls = None
    if cls is None:
        return raw  # validation names what is wrong
    shipped = folder == Path(importlib.import_module("raylane.pipelines").__file__).resolve().parent
    return paths.resolve(raw, cls, Path.cwd() if shipped else folder, inputs_only=True)


def load_config(source: str | Path | Mapping[str, Any], overrides: Iterable[str] = (), *,
                outputs: bool = True) -> BaseConfig:
    """The edge: file (or mapping) + overrides -> a validated config, or ConfigError.
    `outputs`: see validate."""
    if not isinstance(source, (str, Path)):
        return validate(apply_overrides(copy.deepcopy(dict(source)), overrides), outputs=outputs)
    raw = read_yaml(source)
    if "sweep" in raw:  # the file's own, not a `--set sweep.x`, which is an unknown key
        raise ConfigError(f"config file {str(source)!r}: is a sweep file (it has a `sweep:` section): "
                          f"run it with `raylane tune {source}`")
    raw.pop("autotune", None)  # `raylane autotune`'s search space: the rest trains as it is
    raw = apply_overrides(read_config_file(source, raw), overrides)
    return validate(normalize_pipeline(raw, config_path(source).resolve().parent), outputs=outputs)


def format_validation_error(exc: ValidationError, model: type[BaseModel] | None = None, prefix: str = "") -> str:
    """One line for every error; an unknown key of `model` gets the closest known key as a hint
    (`prefix` is how the user writes the model's keys, e.g. `sweep.`)."""
    lines = []
    for err in exc.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            parent = [str(p) for p in err["loc"][:-1]]
            known = [".".join([*parent, k]) for k in _fields_at(model, parent)]
            hint = did_you_mean(field, known).replace("mean ", f"mean {prefix}")
            lines.append(f"{field} = {_short(err['input'])}: unknown key{hint}")
        elif err["type"] == "missing":
            lines.append(f"{field}: required")
        elif err["type"] == "value_error" and _own_message(err.get("ctx", {}).get("error")):
            lines.append(str(err["ctx"]["error"]))  # our own checks name their field and value
        else:
            lines.append(f"{field} = {_short(err['input'])}: {err['msg']}")
    return "invalid config: " + "; ".join(lines)


def _own_message(error: Any) -> bool:
    """A check's error that is complete as it is: one naming its field and value, or a bad value
    in the data (raylane.DataError: the key, the file, the row)."""
    from raylane.loop.baddata import DataError

    return isinstance(error, DataError) or " = " in str(error or "")


def _fields_at(model: Any, path: list[str]) -> list[str]:
    """The keys of the section at `path` below `model` ([] when it is not a section)."""
    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def _maybe_float(text: str) -> Any:
    try:
        value = float(text)
    except ValueError:
        return text
    return value if math.isfinite(value) and re.fullmatch(r"[+-]?\d*\.?\d+[eE][+-]?\d+", text) else text


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
