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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raylane.autotuning.ranking import CONFIDENCE, Ranking, verdict
from raylane.autotuning.record import RECORD_FILE
from raylane.autotuning.report import (
    chosen_line,
    describe,
    estimate_error,
    metrics,
    plot,
    row,
    table,
    write_yaml,
)
from raylane.config import BaseConfig, ConfigError
from raylane.config.autotune import AutotuneSection, SearchSettings, settings, winner_config
from raylane.driver import finalize_run
from raylane.loop.protocols.events import Candidate, Event, Log, Round, SearchEnd, SearchStart
from raylane.loop.protocols.result import Fit, Outcome, SearchResult
from raylane.results import AutotuneSummary, Status
from raylane.results import Candidate as CandidateRow
from raylane.session import RunSession, outcome
from raylane.sweeps.runs import PARENT_TAG

if TYPE_CHECKING:
    from raylane.loop.protocols.runtime import Runtime
    from raylane.onray.spec import LaunchSpec
    from raylane.tracking.runs import RunHandle

log = logging.getLogger("raylane")

# A candidate's child run ends as MLflow's status for how the candidate ended.
CHILD_STATUS = {Fit.OK: Status.FINISHED, Fit.OOM: Status.FAILED, Fit.FAILED: Status.FAILED, Fit.PRUNED: Status.KILLED}


@dataclass(frozen=True, slots=True)
class SearchLaunch:
    """One search as its driver runs it: the config, the settings every rank gets, where the
    ranks run, and the driver's side of it."""

    cfg: BaseConfig
    settings: SearchSettings
    use_ray: bool
    address: str | None
    recorder: Recorder | None  # rank 0's (None on another torchrun rank)
    tracking_uri: str
    session: RunSession


def execute(
    section: AutotuneSection, cfg: BaseConfig, *, use_ray: bool, address: str | None, out: str, summary_path: str | None
) -> AutotuneSummary:
    """Run the search on Ray, as this torchrun rank, or in this process; returns the summary (on
    a torchrun rank other than 0, only its status)."""
    from raylane.loop.distributed.groups import env_ranks
    from raylane.tracking.runs import open_run, resolve_tracking_uri

    launched = time.time()
    if not use_ray:
        from raylane.loop.run import prelude
        from raylane.runrecord import run_folder

        prelude(cfg, run_folder(cfg))  # env:, NCCL's flight recorder and the process group, as for a training run
        # The ranks torchrun started (or this one process), whatever scaling.num_workers says.
        cfg = cfg.model_copy(update={"scaling": cfg.scaling.model_copy(update={"num_workers": env_ranks()[2]})})
    rank0 = use_ray or env_ranks()[0] == 0
    # The search's lease on its folder and its MLflow parent run, given back and closed on every way out.
    with RunSession() as session:
        cfg = finalize_run(_named(cfg), session, rank0)
        storage = cfg.run.storage_path
        record = None if "://" in storage else str(Path(storage) / str(cfg.run.name) / RECORD_FILE)
        tracking_uri = resolve_tracking_uri()
        recorder = None
        if rank0:
            parent = (
                session.open(open_run, cfg, tracking_uri, cfg.scaling.num_workers, session.folder)
                if cfg.mlflow.enabled
                else None
            )
            recorder = Recorder(cfg, tracking_uri, launched, parent)
        launch = SearchLaunch(cfg, settings(section, cfg, record), use_ray, address, recorder, tracking_uri, session)
        return _search(launch, out, summary_path)


def _search(launch: SearchLaunch, out: str, summary_path: str | None) -> AutotuneSummary:
    from raylane.loop.distributed.groups import env_ranks, leave_process_group

    cfg, session = launch.cfg, launch.session
    result: SearchResult | None = None
    try:
        result = _launch(launch)
        status, error = Status.FINISHED, None
    except ConfigError as exc:
        if launch.use_ray:  # a cluster that never answered: one line and exit 2, as for train and tune
            raise  # the session closes the parent run FAILED
        status, error = Status.FAILED, f"ConfigError: {exc}"
    except (KeyboardInterrupt, Exception) as exc:  # the launcher's message names the rank and its exception
        status, error = outcome(exc)
    if not launch.use_ray and cfg.scaling.num_workers and env_ranks()[2] > 1:
        # As for a training run (driver._torchrun_rank_done): only a stop is waited out; after
        # a finished search rank 0's records have no length a peer's wait could bound.
        session.defer(leave_process_group, wait_for_peers=status == Status.KILLED)
    if launch.recorder is None:
        return AutotuneSummary(status=status, error=error, run_name=cfg.run.name)
    summary = launch.recorder.finish(result, status, error, launch.settings, out, summary_path)
    session.close(summary.status)
    return summary


def _named(cfg: BaseConfig) -> BaseConfig:
    if cfg.run.name:
        return cfg
    from raylane import pipelines_ref

    name = f"{pipelines_ref.label(cfg.pipeline)}-autotune-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": name})})


def _launch(launch: SearchLaunch) -> SearchResult | None:
    """The search's result: as this rank's search returned it, or on Ray as rank 0's SearchEnd
    brought it to the recorder (None: the search never ended)."""
    recorder = launch.recorder
    on_event = recorder.on_event if recorder else (lambda e: None)
    if not launch.use_ray:
        from raylane.autotuning.search import run_search
        from raylane.loop.run import local_runtime

        return run_search(launch.cfg, local_runtime(launch.cfg, on_event), launch.settings)
    from concurrent.futures import ThreadPoolExecutor

    from raylane.loop.observe.startup import StartupTimes
    from raylane.onray.cluster import start_ray

    pool = launch.session.enter(ThreadPoolExecutor(1, thread_name_prefix="raylane-start"))
    ray_stopper = start_ray(launch.cfg, launch.address, pool, StartupTimes())
    launch.session.defer(ray_stopper.wait)
    from raylane.onray.launch import launch_on_ray

    try:
        launch_on_ray(
            launch.cfg,
            None,
            launch.tracking_uri,
            on_event,
            embedded=ray_stopper.embedded,
            worker=functools.partial(search_worker, launch.settings),
            restartable=False,
        )
        return recorder.result if recorder else None
    finally:
        ray_stopper.start()


def search_worker(
    settings: SearchSettings, cfg: BaseConfig, runtime: Runtime, spec: LaunchSpec, startup: dict[str, float]
) -> None:
    """The search as a Ray worker group's function (raylane.onray.launch.launch_on_ray's
    `worker`, with the search's settings bound): the whole search runs in that one group."""
    from raylane.autotuning.search import run_search

    run_search(cfg, runtime, settings)


class Recorder:
    """Rank 0's events, on the driver: a line and an MLflow child run per candidate as it ends,
    and at the end the table, the plot, the winner's YAML and the summary."""

    def __init__(self, cfg: BaseConfig, tracking_uri: str, launched: float, parent: RunHandle | None) -> None:
        self.cfg, self.tracking_uri, self.launched = cfg, tracking_uri, launched
        self.parent = parent  # opened and closed by the search's session (raylane.session)
        self.run_ids: list[str | None] = []
        self.search_started: float | None = None
        self.result: SearchResult | None = None  # rank 0's SearchEnd's
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
                print(f"[autotune] {index}: {describe(c)}" + (" (recorded)" if event.replayed else ""), flush=True)
                run_id = None
                if self.parent:
                    run_id = (self._earlier_child(index) if event.replayed else None) or self._child(index, c)
                self.run_ids.append(run_id)
            case Round(index=index, outcome=c):
                print(
                    f"[autotune] {index} again (round {event.rounds}): {describe(c)}"
                    + (" (recorded)" if event.replayed else ""),
                    flush=True,
                )
                run_id = self.run_ids[index] if index < len(self.run_ids) else None
                if run_id and not event.replayed:  # a replayed round is in its child already
                    self.client.log_batch(run_id, metrics=metrics(c, step=event.rounds or 0))
            case SearchEnd():
                self.result = event.result
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

    def _child(self, index: int, c: Outcome) -> str:
        from mlflow.entities import Param, RunTag

        tags = {
            PARENT_TAG: self.parent.run_id,
            "mlflow.runName": f"candidate-{index}",
            "raylane.autotune.status": c.status.value,
        }
        run_id = self.client.create_run(self.parent.experiment_id, tags=tags).info.run_id
        params = [Param(k, str(v)) for k, v in {**c.values, "train.grad_accum_steps": c.grad_accum_steps}.items()]
        self.client.log_batch(
            run_id,
            metrics=metrics(c, step=1),
            params=params,
            tags=[RunTag("raylane.autotune.error", c.error)] if c.error else [],
        )
        self.client.set_terminated(run_id, CHILD_STATUS[c.status])
        return run_id

    def finish(
        self,
        result: SearchResult | None,
        status: Status,
        error: str | None,
        settings: SearchSettings,
        out: str,
        summary_path: str | None,
    ) -> AutotuneSummary:
        """The end of the search: `result` as the search returned it (Search.run; None: it never
        ended), `settings` as it ran with."""
        from raylane.tracking.runs import ui_command

        candidates = result.candidates if result else []
        self.device = result.device if result else None
        ranking = verdict(candidates, settings.own, settings.space)
        best = candidates[ranking.winner] if ranking else None
        if status == Status.FINISHED and best is None:
            status, error = Status.FAILED, "no candidate fitted in memory"
        summary = AutotuneSummary.model_validate(self._summary(candidates, ranking, status, error, settings, out))
        if best is not None and ranking is not None:
            write_yaml(out, winner_config(self.cfg, settings.global_batch, best.values), best, ranking.ties)
        if candidates:
            print(table(candidates, list(settings.space), ranking), flush=True)
        self._artifacts(candidates, summary)
        if self.parent:
            self._tag_verdicts(summary.candidates)
        summary.write(summary_path)
        if best is not None and ranking is not None:
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

    def _summary(
        self,
        candidates: list[Outcome],
        ranking: Ranking | None,
        status: Status,
        error: str | None,
        settings: SearchSettings,
        out: str,
    ) -> dict[str, Any]:
        """AutotuneSummary's fields."""
        ended = time.time()
        startup = (self.search_started - self.launched) if self.search_started else None
        best = candidates[ranking.winner] if ranking else None
        run_ids = self.run_ids + [None] * len(candidates)
        return {
            "status": status,
            "error": error,
            "run_name": self.cfg.run.name,
            "parent_run_id": self.parent.run_id if self.parent else None,
            "tracking_uri": self.tracking_uri,
            "global_batch": settings.global_batch.size,
            "world_size": self.cfg.scaling.num_workers,
            "best": None
            if best is None or ranking is None
            else {
                "candidate": ranking.winner,
                "config": {**best.values, "train.grad_accum_steps": best.grad_accum_steps},
                "samples_per_s": best.samples_per_s,
                "interval": best.interval,
                "rounds": best.rounds,
                "tied_with": ranking.ties[1:],
                "tokens_per_s": best.tokens_per_s,
                "mfu": best.mfu,
                "peak_memory_bytes": best.peak_memory_bytes,
                "yaml": str(Path(out).resolve()),
            },
            "ranking": ranking
            and {
                "leader": ranking.leader,
                "ties": ranking.ties,
                "winner": ranking.winner,
                "clear": ranking.clear,
                "confidence": CONFIDENCE,
                "windows": settings.windows,
                "min_rounds": settings.min_rounds,
                "max_rounds": settings.max_rounds,
            },
            "candidates": [row(c, i, ranking, run_ids[i]) for i, c in enumerate(candidates)],
            "device": self.device,
            "estimate_error": estimate_error(candidates, self.device),
            "timing": {
                "wall_s": ended - self.launched,
                "startup_s": startup,
                "profiling_s": sum(c.profile_s or 0 for c in candidates),
            },
        }

    def _artifacts(self, candidates: list[Outcome], summary: AutotuneSummary) -> None:
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
