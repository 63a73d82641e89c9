"""`raylane autotune CONFIG`: the fastest configuration of a pipeline that fits, on the workers the
config asks for.

The search space is the config's optional `autotune:` section (each knob a list of values,
narrowing the defaults below). The global batch is held: every candidate trains the same model,
changing only how the batch is split (micro-batch x accumulation x workers). One worker group
runs the whole search (`raylane.autotuning.search`: the order, the memory estimate's pruning, the agreed
out-of-memory); this module is the driver's side: validate, launch (Ray, torchrun or one
process), record every candidate as a child of one MLflow parent run, and write the table, a
plot of throughput against memory, the winner as a ready-to-train YAML and the summary."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError, model_validator

from raylane import prechecks
from raylane.autotuning.order import RECORD_FILE
from raylane.autotuning.ranking import CONFIDENCE, verdict
from raylane.autotuning.report import (
    _describe,
    _metrics,
    chosen_line,
    estimate_error,
    plot,
    row,
    table,
    write_yaml,
)
from raylane.batching import GlobalBatch, hold_global_batch
from raylane.config import (
    BaseConfig,
    ConfigError,
    Section,
    apply_overrides,
    apply_values,
    config_path,
    format_validation_error,
    normalize_pipeline,
    read_config_file,
    read_yaml,
    validate,
)
from raylane.lease import LEASE_FILES
from raylane.loop.events import Candidate, Event, Log, Round, SearchStart
from raylane.results import AutotuneSummary, Status
from raylane.results import Candidate as CandidateRow
from raylane.session import RunSession, finalize_run, outcome

if TYPE_CHECKING:
    from raylane.loop.runtime import Runtime
    from raylane.onray.launch import LaunchSpec
    from raylane.tracking.runs import RunHandle

log = logging.getLogger("raylane")

PARENT_TAG = "mlflow.parentRunId"
CHILD_STATUS = {"ok": Status.FINISHED, "oom": Status.FAILED, "failed": Status.FAILED, "pruned": Status.KILLED}


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
    try:
        section = AutotuneSection.model_validate(raw.pop("autotune", None) or {})
    except ValidationError as exc:
        text = format_validation_error(exc, AutotuneSection, "autotune.").removeprefix("invalid config: ")
        raise ConfigError(
            "invalid autotune section: "
            + "; ".join(p if p.startswith("autotune.") else f"autotune.{p}" for p in text.split("; "))
        ) from None
    raw = apply_overrides(
        read_config_file(source, raw), [o for o in overrides if not o.strip().startswith("autotune.")]
    )
    return section, validate(normalize_pipeline(raw, config_path(source).resolve().parent))


def space(section: AutotuneSection, cfg: BaseConfig) -> tuple[dict[str, list[Any]], GlobalBatch]:
    """Dotted key -> values, the config's own value first; and the global batch held. Checks
    every value against the config (ConfigError naming the field and the value)."""
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
    knobs = {
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


def check(section: AutotuneSection, cfg: BaseConfig, out: str, summary_json: str | None) -> None:
    """What can fail before anything starts: the outputs (never overwritten) and the config."""
    prechecks.check_run(cfg, summary_json=summary_json)
    folder = prechecks.run_folder(cfg) if cfg.run.name else None
    if (
        folder is not None
        and folder.is_dir()
        and not (folder / RECORD_FILE).exists()
        and any(p.name not in LEASE_FILES for p in folder.iterdir())
    ):
        raise ConfigError(
            f"run.name = {cfg.run.name!r}: a training run of that name exists in {str(folder)!r}; "
            "give the search a name of its own"
        )
    if Path(out).exists():
        raise ConfigError(
            f"--out = {out!r}: already exists (an earlier autotune's result is never overwritten); name another file"
        )
    prechecks.writable_file("--out", out)


def execute(
    section: AutotuneSection, cfg: BaseConfig, *, use_ray: bool, address: str | None, out: str, summary_path: str | None
) -> AutotuneSummary:
    """Run the search on Ray, as this torchrun rank, or in this process; returns the summary (on
    a torchrun rank other than 0, only its status)."""
    from raylane.loop.distributed import env_ranks, init_process_group
    from raylane.tracking.runs import open_run, resolve_tracking_uri

    launched = time.time()
    if not use_ray:
        init_process_group(cfg.scaling.use_gpu, cfg.dist.timeout_s)
        # The ranks torchrun started (or this one process), whatever scaling.num_workers says.
        cfg = cfg.model_copy(update={"scaling": cfg.scaling.model_copy(update={"num_workers": env_ranks()[2]})})
    rank0 = use_ray or env_ranks()[0] == 0
    # The search's lease on its folder and its MLflow parent run, given back and closed on every way out.
    with RunSession() as session:
        cfg = finalize_run(_named(cfg), session, rank0)
        storage = cfg.run.storage_path
        record = None if "://" in storage else str(Path(storage) / cfg.run.name / RECORD_FILE)
        params = settings(section, cfg, record)
        tracking_uri = resolve_tracking_uri()
        recorder = None
        if rank0:
            parent = session.open(open_run, cfg, tracking_uri, cfg.scaling.num_workers) if cfg.mlflow.enabled else None
            recorder = Recorder(cfg, tracking_uri, launched, parent)
        return _search(cfg, params, use_ray, address, recorder, tracking_uri, out, summary_path, session)


def _search(
    cfg: BaseConfig,
    params: dict[str, Any],
    use_ray: bool,
    address: str | None,
    recorder: Any,
    tracking_uri: str,
    out: str,
    summary_path: str | None,
    session: RunSession,
) -> AutotuneSummary:
    from raylane.loop.distributed import env_ranks, leave_process_group

    try:
        result = _launch(cfg, params, use_ray, address, recorder, tracking_uri, session)
        status, error = Status.FINISHED, None
    except ConfigError as exc:
        if use_ray:  # a cluster that never answered: one line and exit 2, as for train and tune
            raise  # the session closes the parent run FAILED
        result, status, error = {}, Status.FAILED, f"ConfigError: {exc}"
    except (KeyboardInterrupt, Exception) as exc:  # the launcher's message names the rank and its exception
        result, (status, error) = {}, outcome(exc)
    if not use_ray and cfg.scaling.num_workers and env_ranks()[2] > 1:
        # As for a training run (driver._torchrun_rank_done): only a stop is waited out; after
        # a finished search rank 0's records have no length a peer's wait could bound.
        session.defer(leave_process_group, wait_for_peers=status == Status.KILLED)
    if recorder is None:
        return AutotuneSummary(status=status, error=error, run_name=cfg.run.name)
    summary = recorder.finish(result, status, error, params, out, summary_path)
    session.close(summary.status)
    return summary


def _named(cfg: BaseConfig) -> BaseConfig:
    if cfg.run.name:
        return cfg
    from raylane import pipelines_ref

    name = f"{pipelines_ref.label(cfg.pipeline)}-autotune-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name})})


def _launch(
    cfg: BaseConfig,
    params: dict[str, Any],
    use_ray: bool,
    address: str | None,
    recorder: Any,
    tracking_uri: str,
    session: RunSession,
) -> dict[str, Any]:
    on_event = recorder.on_event if recorder else (lambda e: None)
    if not use_ray:
        from raylane.autotuning.search import run_search
        from raylane.loop.run import local_runtime

        return run_search(cfg, local_runtime(cfg, on_event), params)
    from concurrent.futures import ThreadPoolExecutor

    from raylane.loop.startup import StartupTimes
    from raylane.onray.cluster import start_ray

    pool = session.enter(ThreadPoolExecutor(1, thread_name_prefix="raylane-start"))
    ray_stopper = start_ray(cfg, address, pool, StartupTimes())
    session.defer(ray_stopper.wait)
    from raylane.onray.launch import launch_on_ray

    try:
        return launch_on_ray(
            cfg,
            None,
            tracking_uri,
            on_event,
            embedded=ray_stopper.embedded,
            worker=functools.partial(search_worker, params),
            restartable=False,
        )
    finally:
        ray_stopper.start()


def search_worker(
    params: dict[str, Any], cfg: BaseConfig, runtime: Runtime, spec: LaunchSpec, startup: dict[str, float]
) -> None:
    """The search as a Ray worker group's function (raylane.onray.launch.launch_on_ray's
    `worker`, with the search's settings bound): the whole search runs in that one group."""
    from raylane.autotuning.search import run_search

    run_search(cfg, runtime, params)


class Recorder:
    """Rank 0's events, on the driver: a line and an MLflow child run per candidate as it ends,
    and at the end the table, the plot, the winner's YAML and the summary."""

    def __init__(self, cfg: BaseConfig, tracking_uri: str, launched: float, parent: RunHandle | None) -> None:
        self.cfg, self.tracking_uri, self.launched = cfg, tracking_uri, launched
        self.parent = parent  # opened and closed by the search's session (raylane.session)
        self.run_ids: list[str | None] = []
        self.search_started: float | None = None
        if self.parent:
            from raylane.tracking.runs import mlflow_client

            self.client = mlflow_client(tracking_uri)
            self.client.set_tag(self.parent.run_id, "raylane.autotune", "true")
        print(
            f"[raylane] autotune {cfg.run.name}: {cfg.scaling.num_workers} workers"
            + (f"; MLflow parent run {self.parent.run_id}" if self.parent else ""),
            flush=True,
        )

    def on_event(self, event: Event) -> None:
        match event:
            case SearchStart():
                self.search_started = event.time_unix
            case Candidate(index=index, outcome=c):
                print(f"[autotune] {index}: {_describe(c)}" + (" (recorded)" if event.replayed else ""), flush=True)
                run_id = None
                if self.parent:
                    run_id = (self._earlier_child(index) if event.replayed else None) or self._child(index, c)
                self.run_ids.append(run_id)
            case Round(index=index, outcome=c):
                print(
                    f"[autotune] {index} again (round {event.rounds}): {_describe(c)}"
                    + (" (recorded)" if event.replayed else ""),
                    flush=True,
                )
                run_id = self.run_ids[index] if index < len(self.run_ids) else None
                if run_id and not event.replayed:  # a replayed round is in its child already
                    self.client.log_batch(run_id, metrics=_metrics(c, step=event.rounds or 0))
            case Log() if event.level in ("warning", "error"):
                print(f"raylane: warning: {event.message}", flush=True)

    def _earlier_child(self, index: int) -> str | None:
        """The child an earlier launch of this search recorded for candidate `index`."""
        found = self.client.search_runs(
            [self.parent.experiment_id],
            max_results=1,
            filter_string=f"tags.`{PARENT_TAG}` = '{self.parent.run_id}' and tags.`mlflow.runName` = 'candidate-{index}'",
        )
        return found[0].info.run_id if found else None

    def _child(self, index: int, c: dict[str, Any]) -> str:
        from mlflow.entities import Param, RunTag

        tags = {
            PARENT_TAG: self.parent.run_id,
            "mlflow.runName": f"candidate-{index}",
            "raylane.autotune.status": c["status"],
        }
        run_id = self.client.create_run(self.parent.experiment_id, tags=tags).info.run_id
        params = [
            Param(k, str(v)) for k, v in {**c["values"], "train.grad_accum_steps": c.get("grad_accum_steps")}.items()
        ]
        self.client.log_batch(
            run_id,
            metrics=_metrics(c, step=1),
            params=params,
            tags=[RunTag("raylane.autotune.error", c["error"])] if c.get("error") else [],
        )
        self.client.set_terminated(run_id, CHILD_STATUS[c["status"]])
        return run_id

    def finish(
        self,
        result: dict[str, Any],
        status: Status,
        error: str | None,
        params: dict[str, Any],
        out: str,
        summary_path: str | None,
    ) -> AutotuneSummary:
        from raylane.tracking.runs import ui_command

        candidates = result.get("candidates", [])
        self.device = result.get("device")
        ranking = verdict(candidates, params["own"], params["space"])
        best = candidates[ranking["winner"]] if ranking else None
        if status == Status.FINISHED and best is None:
            status, error = Status.FAILED, "no candidate fitted in memory"
        summary = AutotuneSummary.model_validate(self._summary(candidates, ranking, status, error, params, out))
        if best is not None:
            write_yaml(out, winner_config(self.cfg, params["global_batch"], best["values"]), best, ranking["ties"])
        if candidates:
            print(table(candidates, list(params["space"]), ranking), flush=True)
        self._artifacts(candidates, summary)
        if self.parent:
            self._tag_verdicts(summary.candidates)
        summary.write(summary_path)
        if best is not None:
            print(f"[raylane] {chosen_line(candidates, ranking)}; wrote {out} (raylane train {out})", flush=True)
        if error:
            print(f"raylane: autotune {status.lower()}: {error}", flush=True)
        if self.parent:
            print(f"[raylane] MLflow: {ui_command(self.tracking_uri, self.parent)}", flush=True)
        return summary

    def _tag_verdicts(self, rows: list[CandidateRow]) -> None:
        for r in rows:
            if r.run_id and r.verdict:
                self.client.set_tag(r.run_id, "raylane.autotune.verdict", r.verdict)

    def _summary(self, candidates, ranking, status, error, params, out) -> dict[str, Any]:
        ended = time.time()
        startup = (self.search_started - self.launched) if self.search_started else None
        best = candidates[ranking["winner"]] if ranking else None
        run_ids = self.run_ids + [None] * len(candidates)
        return {
            "status": status,
            "error": error,
            "run_name": self.cfg.run.name,
            "parent_run_id": self.parent.run_id if self.parent else None,
            "tracking_uri": self.tracking_uri,
            "global_batch": params["global_batch"]["size"],
            "world_size": self.cfg.scaling.num_workers,
            "best": None
            if best is None
            else {
                "candidate": ranking["winner"],
                "config": {**best["values"], "train.grad_accum_steps": best.get("grad_accum_steps")},
                "samples_per_s": best["samples_per_s"],
                "interval": best.get("interval"),
                "rounds": best.get("rounds"),
                "tied_with": ranking["ties"][1:],
                "tokens_per_s": best.get("tokens_per_s"),
                "mfu": best.get("mfu"),
                "peak_memory_bytes": best.get("peak_memory_bytes"),
                "yaml": str(Path(out).resolve()),
            },
            "ranking": ranking
            and {
                **ranking,
                "clear": len(ranking["ties"]) == 1,
                "confidence": CONFIDENCE,
                "windows": params["windows"],
                "min_rounds": params["min_rounds"],
                "max_rounds": params["max_rounds"],
            },
            "candidates": [row(c, i, ranking, run_ids[i]) for i, c in enumerate(candidates)],
            "device": self.device,
            "estimate_error": estimate_error(candidates, self.device),
            "timing": {
                "wall_s": ended - self.launched,
                "startup_s": startup,
                "profiling_s": sum(c.get("profile_s") or 0 for c in candidates),
            },
        }

    def _artifacts(self, candidates: list[dict[str, Any]], summary: AutotuneSummary) -> None:
        if not (self.parent and candidates):
            return
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            png = Path(d) / "autotune.png"
            plot(png, candidates)
            (Path(d) / "autotune.json").write_text(summary.to_json())
            self.client.log_artifact(self.parent.run_id, str(png), "plots")
            self.client.log_artifact(self.parent.run_id, str(Path(d) / "autotune.json"))
        if summary.best:
            self.client.log_metric(self.parent.run_id, "best/samples_per_s", summary.best.samples_per_s)


def settings(section: AutotuneSection, cfg: BaseConfig, record: str | None) -> dict[str, Any]:
    knobs, held = space(section, cfg)
    flat = cfg.flat()
    return {
        "space": knobs,
        "own": {k: flat[k] for k in knobs},
        "global_batch": held.model_dump(),
        "warmup_steps": section.warmup_steps,
        "profile_steps": section.profile_steps,
        "windows": section.windows,
        "min_window_s": section.min_window_s,
        "min_rounds": section.min_rounds,
        "max_rounds": section.max_rounds,
        "max_candidates": section.max_candidates,
        "budget_s": section.budget_s,
        "safety_margin": section.safety_margin,
        "record": record,
    }


def winner_config(cfg: BaseConfig, held: dict[str, Any], values: dict[str, Any]) -> BaseConfig:
    """The winner, as it trains: a train.global_batch of the config's own is kept (with the split
    the search measured), so that a resume on another world size holds it as before."""
    won = hold_global_batch(apply_values(cfg, values), GlobalBatch(**held), "autotune.global_batch")
    if cfg.train.global_batch is None:
        return won
    return won.model_copy(
        update={
            "train": won.train.model_copy(
                update={"global_batch": held["size"], "global_batch_adjust": "grad_accum_steps"}
            )
        }
    )
