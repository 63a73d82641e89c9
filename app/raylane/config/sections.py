"""The sections every pipeline's config shares (`run`, `scaling`, `strategy`, `train`, `optim`,
`loader`, `checkpoint`, `failure`, `dist`, `mlflow`), which raylane.config.base.BaseConfig holds
(`strategy` lives in raylane.config.strategy, `Section` in raylane.config.section; both imported here).
Each field carries its description (docs/configuration.md is generated from them) and its range;
a check across a section's fields raises a message that names the field and the value. Nothing
here imports torch or Ray."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raylane.config.section import Section
from raylane.config.strategy import StrategySection
from raylane.paths import InputPath, OutputPath

# The one list of the shared sections' names: raylane.config exports these (BaseConfig holds each
# section as a field). A new section: its class here (or beside, imported here), its name below, its
# field in BaseConfig.
__all__ = [
    "EPOCHS_AS_NEEDED",
    "NAME_PATTERN",
    "CheckpointSection",
    "DistSection",
    "EarlyStoppingSection",
    "FailureSection",
    "LoaderSection",
    "MlflowSection",
    "OptimSection",
    "RunSection",
    "ScalingSection",
    "Section",
    "StrategySection",
    "TrainSection",
]

# A run's or a sweep's name: it names a folder, and MLflow shows it.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class RunSection(Section):
    """A run's identity and where it writes."""

    name: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="The run's identity: relaunching the same name resumes it (its checkpoints and its MLflow run). "
        "null: `<pipeline>-<timestamp>`.",
    )
    storage_path: OutputPath = Field(
        "runs",
        min_length=1,
        description="Where checkpoints go, in `<storage_path>/<run.name>/`: a folder (one all nodes share, on a "
        "cluster) or `s3://bucket/prefix`. A relative path is taken from the working directory, beside "
        "MLflow's default store.",
    )


class ScalingSection(Section):
    """How many workers, on what."""

    num_workers: int = Field(
        1,
        ge=1,
        le=4096,
        description="Training workers (ranks), one per GPU with `use_gpu`. Or `[min, max]` (`--set "
        "scaling.num_workers=1,2`): an elastic run on Ray, which starts once `min` workers fit, grows to "
        "`max` as nodes join and goes on with the survivors when one is lost.",
    )
    min_workers: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="An elastic run's smallest group, set through `num_workers: [min, max]`. null: not elastic.",
    )
    resize_check_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="Elastic runs: seconds between two checks, by a healthy group, of whether more workers fit now.",
    )
    use_gpu: bool = Field(False, description="One worker per GPU, on NCCL. false: CPU workers, on gloo.")
    cpus_per_worker: float = Field(
        1.0, gt=0, le=1024, description="CPUs Ray reserves for each worker (fractions allowed)."
    )
    gpus_per_worker: float = Field(
        1.0,
        gt=0,
        le=64,
        description="GPUs per worker with `use_gpu`. A fraction packs several small Tune trials onto one GPU, one "
        "worker each (NCCL cannot run two ranks of one group on the same GPU).",
    )
    device_memory_gb: float | None = Field(
        None,
        gt=0,
        le=1_000_000,
        description="One device's memory in GB, for `strategy.name: auto`, `strategy.tp: auto` and `strategy.ep: auto`. "
        "null: detected (the GPU's memory, or on CPU this host's RAM shared by its ranks).",
    )
    accelerator_type: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
        description="Workers only on nodes with this accelerator (Ray's type: `H100`, `A100`, `L4`, `TPU-V6E`, ...: "
        "the node's `accelerator_type:<type>` resource). null: any node with the resources asked.",
    )
    resources_per_worker: dict[str, float] = Field(
        {},
        description="Custom Ray resources each worker asks for besides its CPUs and GPUs (`{name: amount}`, e.g. "
        "`{spot: 1}` for nodes started with `--resources '{\"spot\": 8}'`); a worker lands only where they are free.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="How Ray places the workers' placement group: PACK (as few nodes as it can), SPREAD (as many), "
        "STRICT_PACK (one node, or wait), STRICT_SPREAD (one worker a node, or wait).",
    )
    label_selector: dict[str, str] = Field(
        {},
        description="Workers only on nodes whose Ray labels match (`{label: value}`; Ray's syntax for a value: "
        "`a`, `!a`, `in(a,b)`, `!in(a,b)`), e.g. `{ray.io/market-type: spot}` or a label given to `ray start "
        "--labels`. {}: any node.",
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        le=1_000_000,
        description="One device's dense peak TFLOP/s at `train.precision`, for MFU. null: the GPU looked up in "
        "raylane's table (raylane.loop.distributed.devices); no MFU on CPU unless given.",
    )

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

    @field_validator("resources_per_worker")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory") or name.startswith(("accelerator_type:", "node:")):
                raise ValueError(
                    f"scaling.resources_per_worker.{name} = {amount!r}: set by scaling.cpus_per_worker, "
                    "gpus_per_worker or accelerator_type, or by Ray itself; name custom resources here"
                )
            if not name or not 0 < amount <= 1_000_000:
                raise ValueError(f"scaling.resources_per_worker.{name} = {amount!r}: needs a name and 0 < amount")
        return value

    @model_validator(mode="after")
    def _min_at_most_max(self) -> ScalingSection:
        if self.min_workers is not None and self.min_workers > self.num_workers:
            raise ValueError(
                f"scaling.min_workers = {self.min_workers}: more than scaling.num_workers = {self.num_workers}"
            )
        return self

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers < self.num_workers


class EarlyStoppingSection(Section):
    """Ends the run FINISHED, with a checkpoint, once a held-out metric stops improving."""

    metric: str = Field(
        "loss",
        min_length=1,
        description="The held-out metric watched, named as `checkpoint.best_metric` names it (`loss`; `val/loss` "
        "for a named held-out set).",
    )
    mode: Literal["min", "max"] = Field("min", description="`min`: lower is better; `max`: higher is better.")
    patience: int = Field(
        3, ge=1, le=1_000_000, description="Evaluations in a row without improvement after which the run stops."
    )
    min_delta: float = Field(
        0.0, ge=0, description="An evaluation improves only when it beats the best so far by more than this."
    )


# The epochs a run may take when `train.max_steps` decides alone (`TrainSection.epoch_limit`).
EPOCHS_AS_NEEDED = 1_000_000


class TrainSection(Section):
    """How long and how: epochs, steps, batches, precision, evaluation."""

    max_epochs: int | None = Field(
        None,
        ge=1,
        le=EPOCHS_AS_NEEDED,
        description="Passes over the training set, at most. null: 1, or, when `max_steps` is set, as many as it takes.",
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Stop after this many optimizer steps, mid-epoch if need be, over as many epochs as they take, "
        "unless `max_epochs` is set lower. null: `max_epochs` decides.",
    )
    batch_size: int = Field(
        32,
        ge=1,
        le=1_000_000,
        description="Samples per worker per micro-batch: an optimizer step takes batch_size x grad_accum_steps x "
        "workers samples.",
    )
    seed: int = Field(
        0,
        ge=0,
        lt=2**32,
        description="Seeds the weights (every rank, before the pipeline's `build`) and the data order.",
    )
    on_nan: Literal["stop", "skip"] = Field(
        "stop",
        description="A non-finite loss or gradient: `stop` with an error naming the step, or `skip` that update.",
    )
    grad_accum_steps: int = Field(
        1,
        ge=1,
        le=65_536,
        description="Micro-batches per optimizer step; gradients are reduced across workers on the last one only.",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Autocast (DDP, one process) or FSDP's parameter dtype. `fp16` adds a gradient scaler and needs "
        "`strategy.name: ddp`.",
    )
    grad_clip_norm: float | None = Field(
        None, gt=0, description="Clip the global gradient norm (over all shards) to this value. null: no clipping."
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each block's activations in backward instead of keeping them: less memory, "
        "more compute.",
    )
    compile: bool = Field(False, description="`torch.compile` each block (or the whole model when it has no blocks).")
    eval_every_n_epochs: int = Field(
        1,
        ge=0,
        description="Evaluate on the held-out set every N epochs. 0: only at the end of the run, which is always "
        "evaluated.",
    )
    eval_every_n_steps: int = Field(
        0,
        ge=0,
        description="Also evaluate every N optimizer steps (0: off), for runs of few, long epochs; a checkpoint due "
        "at such a step carries the metrics.",
    )
    early_stopping: EarlyStoppingSection | None = Field(
        None,
        description="Stop when a held-out metric stops improving: `{metric, mode, patience, min_delta}`. null: off.",
    )
    global_batch: int | None = Field(
        None,
        ge=1,
        le=1_000_000_000,
        description="Samples per optimizer step, held at any number of workers (`global_batch_adjust` is computed "
        "from the others): a resume on another world size continues the epoch at the next sample. "
        "null: batch_size x grad_accum_steps x workers, and a resume on another world size restarts "
        "the epoch.",
    )
    global_batch_adjust: Literal["grad_accum_steps", "batch_size"] = Field(
        "grad_accum_steps",
        description="With `global_batch`: the key computed so that batch_size x grad_accum_steps x workers equals it.",
    )

    @property
    def epoch_limit(self) -> int:
        """The epochs the run may take: `max_epochs` when set; else 1, or as many as `max_steps`
        takes when that is set (`max_steps` means what it says). Null in the config rather than
        a number written at validation, so that a config passed on (a sweep's trial with its own
        `max_steps`, a checkpoint's record) still says the user set no limit."""
        if self.max_epochs is not None:
            return self.max_epochs
        return 1 if self.max_steps is None else EPOCHS_AS_NEEDED

    @model_validator(mode="after")
    def _early_stopping_needs_evaluations(self) -> TrainSection:
        if self.early_stopping is not None and not (self.eval_every_n_epochs or self.eval_every_n_steps):
            raise ValueError(
                f"train.early_stopping.metric = {self.early_stopping.metric!r}: early stopping counts "
                "evaluations, and train.eval_every_n_epochs and train.eval_every_n_steps are both 0 "
                "(the run would never stop early); set one of them"
            )
        return self


class LoaderSection(Section):
    """The DataLoader of a map-style dataset (a FileSource streams its own batches)."""

    # 0 by default, as the HF Trainer and Accelerate: in-memory tensors gain nothing from workers,
    # which only add start-up time; on CPU the rank's compute already uses the cores.
    num_workers: int | Literal["auto"] = Field(
        0,
        description="Processes loading batches beside each rank, 0 to 256. 0: in the rank's own process. `auto`: "
        "min(4, the rank's share of the host's cores - 1) on a GPU, 0 on CPU.",
    )
    pin_memory: bool | None = Field(
        None,
        description="Batches in page-locked memory, copied to the GPU without blocking (needs "
        "`scaling.use_gpu`). null: true on a GPU.",
    )
    persistent_workers: bool | None = Field(
        None,
        description="Keep the loader's workers between epochs and evaluations (needs `num_workers` > 0). "
        "null: true when there are workers.",
    )
    prefetch_factor: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="Batches each loader worker loads ahead (needs `num_workers` > 0). null: torch's default, 2.",
    )

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 256):
            return value
        raise ValueError(f"loader.num_workers = {short(value)}: expected a number of workers from 0 to 256, or auto")

    @model_validator(mode="after")
    def _needs_workers(self) -> LoaderSection:
        if self.num_workers == 0:
            for key in ("prefetch_factor", "persistent_workers"):
                if getattr(self, key):
                    raise ValueError(
                        f"loader.{key} = {getattr(self, key)}: needs loader.num_workers > 0 "
                        "(it sets the worker processes, and there are none)"
                    )
        return self


class OptimSection(Section):
    """The optimizer and its learning-rate schedule (a pipeline may bring its own: docs/pipelines.md)."""

    name: Literal["sgd", "adam", "adamw"] = Field(
        "sgd", description="The optimizer; Adam and AdamW use the fused kernel where the device has one."
    )
    lr: float = Field(1e-3, gt=0, le=10, description="The learning rate (the peak, after any warmup).")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD's momentum.")
    weight_decay: float = Field(
        0.0, ge=0, le=1, description="Weight decay; not applied to biases and norm layers unless `decay_norm_and_bias`."
    )
    decay_norm_and_bias: bool = Field(
        False,
        description="With `weight_decay`: decay biases and normalization weights too. false: no decay on 1-D "
        "parameters and on any parameter of a norm layer (LayerNorm, RMSNorm, BatchNorm, ...).",
    )
    schedule: Literal["constant", "cosine", "linear", "wsd"] = Field(
        "constant",
        description="After the warmup: `constant`; `cosine` or `linear` decay to lr x `min_lr_ratio` at the last "
        "step; or `wsd` (warmup-stable-decay): lr held, then a linear decay over the last "
        "`decay_fraction` of the steps. The last step follows `train.max_steps` or `max_epochs`, on a "
        "relaunch too.",
    )
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup, from lr/warmup_steps to lr.")
    decay_fraction: float = Field(
        0.2,
        gt=0,
        le=1,
        description="`wsd`: the last fraction of the steps over which lr decays (starting no earlier than the "
        "warmup's end: a run too short for both says so and shortens the decay).",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="The final lr as a fraction of `lr` (`cosine`, `linear`, `wsd`)."
    )


class CheckpointSection(Section):
    """When checkpoints are saved, which are kept, and where a run starts from."""

    every_n_steps: int = Field(0, ge=0, description="Save every N optimizer steps. 0: only at epoch ends.")
    every_n_epochs: int = Field(
        1,
        ge=0,
        description="Also save at the end of every N epochs; 0: not at epoch ends. The end of the run and a stop "
        "(preemption) always save.",
    )
    # 3, not all: a 40-epoch run would otherwise leave 50 folders, and resume only needs the
    # latest (the others cover a bad one).
    keep: int | None = Field(
        3, ge=1, description="Keep only the newest N committed checkpoints (and the `keep_best`). null: keep all."
    )
    keep_best: int | None = Field(
        None,
        ge=1,
        description="Also keep the N best checkpoints by `best_metric`, measured at epoch ends. null: "
        "none kept for that.",
    )
    best_metric: str = Field(
        "loss",
        min_length=1,
        description="The held-out metric `keep_best` ranks by (`loss`; `val/loss` for a named held-out set).",
    )
    best_mode: Literal["min", "max"] = Field(
        "min", description="`min`: a lower `best_metric` is better; `max`: a higher one."
    )
    async_save: bool = Field(
        True,
        description="Copy the state between two steps, then write, checksum and commit it (agreed by every rank) on "
        "a background thread while training goes on. false: the whole save on the training thread.",
    )
    on_error: Literal["fail", "warn"] = Field(
        "fail", description="A save that fails (disk full, an I/O error): `fail` the run, or `warn` and train on."
    )
    init_from: InputPath | None = Field(
        None,
        description="Start from this checkpoint (weights, optimizer, step) when the run has none of its own: "
        "fine-tuning, or PBT continuing another trial's state. A local or shared path.",
    )


class FailureSection(Section):
    """What a lost worker or node costs the run."""

    max_failures: int = Field(
        0,
        ge=-1,
        description="Worker-group restarts, from the newest committed checkpoint, before the run fails; -1: no limit.",
    )


class DistSection(Section):
    """The process group."""

    timeout_s: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="Seconds a collective may wait: a rank stuck outside one fails the run after this long, naming "
        "it and the file:line where it stood, with every rank's stack in `<storage_path>/<run.name>/stacks/` "
        "(Ray's default is 1800 s).",
    )
    flight_recorder_entries: int = Field(
        2000,
        ge=0,
        le=1_000_000,
        description="On GPUs (NCCL): the collectives each rank's flight recorder keeps (TORCH_NCCL_TRACE_BUFFER_SIZE), "
        "dumped on a collective's timeout into `<storage_path>/<run.name>/stacks/`; 0: off. No effect on CPUs (gloo).",
    )


class MlflowSection(Section):
    """What the run records in MLflow."""

    enabled: bool = Field(
        True,
        description="false: no MLflow run at all (benchmarks, quick experiments); the summary still has the results.",
    )
    experiment: str = Field("raylane", min_length=1, max_length=256, description="The MLflow experiment of the run.")
    log_every_n_steps: int = Field(
        10,
        ge=1,
        description="Log rank 0's training loss, lr and samples/s every N steps, over the steps since the last.",
    )
    log_checkpoints: Literal["uri", "artifacts"] = Field(
        "uri", description="Record checkpoints on the run by location (`uri`), or copy them as `artifacts`."
    )
    log_model: bool = Field(
        True, description="At the end of a finished run, log the final model as an MLflow PyTorch model, and plots."
    )
    system_metrics: bool = Field(
        True,
        description="CPU, memory, disk, network and GPUs of every node that runs a rank, as `system/<node>/*` (one "
        "sampler per node); and MLflow's own system metrics of rank 0's process (`system/*`).",
    )
    system_metrics_interval_s: float = Field(
        10.0, ge=1, le=3600, description="Seconds between two samples of the system metrics, on each node."
    )
    system_metrics_silent_after: int = Field(
        3,
        ge=2,
        le=1000,
        description="A node with no new system-metrics sample for this many intervals is named once: on the "
        "terminal and as the run's tag `raylane.node_silent.<node>`.",
    )


def short(value: Any, limit: int = 60) -> str:
    """`repr(value)`, cut to `limit` characters: a bad value named in a one-line error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
