"""What every rank runs, whoever launched it: build the pipeline, parallelize, resume, train.

`run_worker` is the whole per-rank program. Under Ray Train it is called by `raylane.onray.launch`; under
torchrun or in a single process by `launch_local` below. It never imports Ray."""

from __future__ import annotations

import datetime
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from raylane.config import BaseConfig
from raylane.config.batching import HeldBatch, held_for
from raylane.loop import checkpoint, usercode
from raylane.loop.checkpoint import frozen
from raylane.loop.checkpoint.saving import Saver
from raylane.loop.checkpoint.storage import CheckpointStore, filesystem_for
from raylane.loop.data.loader import data_ranks, eval_data, first_batch, is_stream, train_data, worker_options
from raylane.loop.distributed.devices import peak_flops
from raylane.loop.distributed.fsdp import Strategy, on_meta, resharded, unwrap
from raylane.loop.distributed.ft import OneReplica, train_ranks, world_of
from raylane.loop.distributed.ft_manager import replicas_for
from raylane.loop.distributed.groups import default_device, env_ranks, init_process_group
from raylane.loop.distributed.parallelize import parallelize
from raylane.loop.evaluation import EvalSets, Evaluator
from raylane.loop.observe import faults, hangs, health
from raylane.loop.observe.observer import Deferred, Observer
from raylane.loop.observe.observers import Observers
from raylane.loop.observe.startup import FirstBatchClock, with_phases
from raylane.loop.observe.steptimes import StepTimes
from raylane.loop.optim import build_optimizer, build_scheduler, schedule_note
from raylane.loop.protocols.batches import Forward
from raylane.loop.protocols.events import Event
from raylane.loop.protocols.result import RunResult
from raylane.loop.protocols.runtime import LocalRuntime, Runtime
from raylane.loop.reporting import Reporter
from raylane.loop.steps import Throughput, plan_steps
from raylane.loop.trainer import Parts, Trainer

log = logging.getLogger("raylane")


def seed_everything(seed: int) -> None:
    # The same seed on every rank: identical initial weights even before DDP's broadcast.
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _side_groups(cfg: BaseConfig, world_size: int) -> tuple[Any, Any]:
    """(group for step-boundary votes, group for async checkpoint writes). Votes use gloo on
    the CPU so they never wait on a CUDA stream; async saves run their collectives on a
    background thread, which must not share a group with the training loop's."""
    if world_size == 1 or not dist.is_initialized():
        return None, None
    # dist.timeout_s bounds their waits too: torch's default for a new group is 30 minutes.
    bound = datetime.timedelta(seconds=cfg.dist.timeout_s)
    control = dist.new_group(backend="gloo", timeout=bound) if cfg.scaling.use_gpu else None
    saves = dist.new_group(backend="gloo", timeout=bound) if cfg.checkpoint.async_save else None
    return control, saves


def run_worker(
    cfg: BaseConfig,
    runtime: Runtime,
    metric_logger: Any | None = None,
    startup: dict[str, float] | None = None,
    *,
    held: HeldBatch | None = None,
) -> RunResult:
    """One rank's whole run. Returns the result (the same on every rank but for timings).
    `startup`: the launcher's start-up phases on this rank (see raylane.loop.observe.startup); rank 0 adds
    its own and sends them with its start and first-step events. `held`: train.global_batch as the
    launch held it before it started, on the world it planned (held here only on another: an
    elastic run's size is known only here). An exception of the user's pipeline code leaves it as
    one line naming the function and the place (raylane.loop.usercode)."""
    startup = {} if startup is None else startup
    cfg = held_for(cfg, world_of(runtime.world_size), held)  # the whole run's, with replica groups
    seed_everything(cfg.train.seed)
    pipe = None
    sampler = health.start_sampler(cfg, runtime.local_rank, runtime.store)  # this node's, on its local rank 0
    folder = runtime.store.root if runtime.store.direct else None  # where every rank's stacks go on a hang
    flight_recorder(cfg, folder)  # the dump's path, where the run's name was not known before its group
    try:
        with hangs.watched(folder, runtime.rank, runtime.world_size, cfg.dist.timeout_s) as watch:
            pipe = usercode.build_pipeline(cfg)  # its exception, or a return that is no Pipeline, names the pipeline
            startup["pipeline"] = time.time()
            publish = with_phases(runtime.publish, startup) if runtime.rank == 0 else runtime.publish
            reporter = Reporter(is_rank_zero=runtime.rank == 0, publish=publish, metric_logger=metric_logger)
            trainer = build_trainer(cfg, runtime, pipe, reporter, startup, hang_watch=watch)
            startup["ready"] = time.time()
            return trainer.train()
    except hangs.HangError as exc:  # one line already: the ranks that never came, and where they stood
        usercode.keep_traceback(exc, exc)
        raise
    except Exception as exc:
        explained = usercode.explain(exc, cfg, pipe)
        usercode.keep_traceback(explained, exc)
        if explained is exc:
            raise
        raise explained from exc
    finally:
        if sampler is not None:
            sampler.stop()


def build_trainer(
    cfg: BaseConfig,
    runtime: Runtime,
    pipe: Any,
    reporter: Reporter | None = None,
    startup: dict[str, float] | None = None,
    *,
    hang_watch: hangs.HangWatch | None = None,
) -> Trainer:
    """This rank's Trainer over the pipeline `pipe`: the model parallelized, its optimizer, schedule
    and loaders built from `cfg`, resumed from the run's newest checkpoint (or from
    `checkpoint.init_from`) when there is one. What `run_worker` trains, and what a test builds in
    one process (`reporter`: rank 0's, publishing to `runtime.publish` when not given; `startup`:
    the start-up phases, marked as they end; `hang_watch`: run_worker's, re-armed at each step)."""
    startup = {} if startup is None else startup
    reporter = reporter or Reporter(is_rank_zero=runtime.rank == 0, publish=runtime.publish)
    # Only the autos estimate memory: the user's collate_fn runs no more than needed.
    estimating = "auto" in (cfg.strategy.name, cfg.strategy.tp, cfg.strategy.ep) and runtime.world_size > 1
    example = first_batch(pipe.train_set, cfg.train.batch_size, pipe.collate_fn) if estimating else None
    meta = on_meta(pipe.model)
    model, strategy = parallelize(
        pipe.model,
        cfg,
        runtime.device,
        runtime.world_size,
        example=example,
        loss_fn=pipe.loss_fn,
        step=pipe.step,
        blocks=pipe.blocks,
        tp_plan=pipe.tp_plan,
        pp_stages=pipe.pp_stages,
        ep_plan=pipe.ep_plan,
    )
    startup["parallelize"] = time.time()
    if getattr(strategy, "pp", 1) > 1:  # a pipeline stage: each rank saves its own parameters
        checkpoint.state.mark_partial(model)
    latest, own = _start_point(cfg, runtime, pipe, model, meta)
    # Over the wrapped model's parameters (DTensors under FSDP), in their shards whatever ran before.
    optimizer = build_optimizer(resharded(model), cfg, pipe)
    replicas = replicas_for(cfg, runtime, model, optimizer, reporter)  # torchft's, with replica groups
    # Its loaders, schedule, side groups and observers: what the Trainer is built over, beside them.
    train_loader, parts, saver, observers = _parts(
        cfg, runtime, pipe, reporter, startup, (strategy, optimizer, replicas), hang_watch
    )
    trainer = Trainer(
        model,
        train_loader,
        optimizer,
        parts,
        config=cfg,
        runtime=runtime,
        saver=saver,
        reporter=reporter,
        observers=observers,
    )
    usercode.check_first_calls(trainer, pipe, cfg)
    if latest:
        _resume(trainer, latest, own=own, runtime=runtime)
    return trainer


def _start_point(
    cfg: BaseConfig, runtime: Runtime, pipe: Any, model: torch.nn.Module, meta: bool
) -> tuple[str | None, bool]:
    """Where the run starts: (the checkpoint it resumes from, None at step 0; whether that is the
    run's own newest or checkpoint.init_from's), and, where the checkpoint will not give them, the
    weights the pipeline's init_weights gives."""
    own = runtime.store.latest()
    latest = own or _init_from(cfg)
    # A checkpoint holds every weight, nothing to read twice; except a model on a frozen base
    # (LoRA), whose checkpoints hold what trains: its base comes from its files again.
    if not latest or frozen.base_of(model) is not None:
        _init_weights(pipe, model, meta)
    return latest, bool(own)


def _parts(
    cfg: BaseConfig,
    runtime: Runtime,
    pipe: Any,
    reporter: Reporter,
    startup: dict[str, float],
    built: tuple[Strategy, torch.optim.Optimizer, OneReplica],
    hang_watch: hangs.HangWatch | None,
) -> tuple[Any, Parts, Saver, Observers]:
    """What the Trainer over the parallelized model (laid out as `built`'s Strategy), its
    optimizer and its replica groups is built with: (the training loader, its Parts: schedule,
    evaluation, side groups, ..., its Saver, its Observers)."""
    strategy, optimizer, replicas = built
    batching = {
        "batch_size": cfg.train.batch_size,
        "seed": cfg.train.seed,
        "collate_fn": pipe.collate_fn,
        "options": worker_options(cfg.loader, runtime.device),
    }
    # By data-parallel rank: a tensor-parallel group, and a pipeline's stages, read the same batches.
    # Evaluation sums over every rank all the same: each group's ranks add the same sums and counts
    # (a pipeline's last stage alone counts), and the means hold.
    data = data_ranks(runtime, strategy.layout)
    # The training data across replica groups too (the held-out sets are each group's to measure).
    train_loader = _train_loader(cfg, runtime, pipe, train_ranks(data, replicas), batching, strategy.pp, startup)
    eval_loader = eval_data(pipe.eval_set, data, **batching)
    control_group, save_group = _side_groups(cfg, runtime.world_size)
    total_steps = plan_steps(train_loader, cfg.train)[1]
    if runtime.rank == 0 and (note := schedule_note(cfg, total_steps, pipe)):
        log.warning("%s", note)
    plan = faults.load(runtime.rank)  # RAYLANE_FAULTS: the loop's and the saver's
    parts = Parts(
        forward=Forward(
            pipe.loss_fn, pipe.step, runtime.device, split_logits=strategy.tp > 1 and strategy.loss_parallel
        ),
        strategy=strategy,
        scheduler=build_scheduler(optimizer, cfg, total_steps, pipe),
        throughput=Throughput(
            pipe.tokens_per_sample,
            pipe.flops_per_token,
            peak_flops(runtime.device, cfg.train.precision, cfg.scaling.peak_tflops),
            real_tokens=pipe.real_tokens,
        ),
        evaluator=_evaluator(eval_loader, pipe, runtime),
        hooks=pipe.hooks,
        vote_group=control_group,
        replicas=replicas,
    )
    saver = Saver(runtime.store, cfg.checkpoint, reporter, group=save_group, faults=plan)
    return train_loader, parts, saver, _observers(cfg, runtime, reporter, hang_watch, plan)


def _observers(
    cfg: BaseConfig, runtime: Runtime, reporter: Reporter, hang_watch: hangs.HangWatch | None, plan: Any
) -> Observers:
    """What watches this rank's loop: its step times, a torch.profiler window where this rank is
    profiled (by number, or once named the slowest), the hang watch, the faults planned."""
    slowest = _slowest_profiler(cfg, runtime)
    return Observers(
        step_times=_step_times(cfg, runtime, reporter, slowest),
        profiler=_profiler(cfg, runtime) or slowest,
        hang_watch=hang_watch,
        faults=plan,
    )


def _step_times(cfg: BaseConfig, runtime: Runtime, reporter: Reporter, slowest: Deferred | None) -> StepTimes:
    """This rank's step timer; the straggler watch on rank 0 (reported through `reporter`), and on
    a rank that profiles itself once named the slowest (the same watch over the same figures,
    beginning `slowest`, its profiler deferred to then)."""
    s = cfg.stragglers
    return StepTimes(
        cfg.mlflow.log_every_n_steps,
        s.factor,
        s.windows,
        active=runtime.rank == 0 or slowest is not None,
        enabled=s.enabled,
        rank=runtime.rank,
        sink=reporter,
        on_named=slowest.begin if slowest is not None else None,
    )


def _profiler(cfg: BaseConfig, runtime: Runtime) -> Any:
    """torch.profiler's window on this rank (profile.*), or None: not profiled, nothing imported."""
    if not (cfg.profile.enabled and runtime.rank in cfg.profile.ranks):
        return None
    from raylane.loop.observe.profiling import StepProfiler

    return StepProfiler(cfg.profile, runtime.store, runtime.rank, runtime.device)


def _slowest_profiler(cfg: BaseConfig, runtime: Runtime) -> Deferred | None:
    """profile.ranks' `slowest`, on a rank not profiled by number: its profiler, Deferred to the
    step the step times name this rank the straggler (one window from its next step: wait 0,
    warmup 1, `active` steps; no memory snapshot, whose history would start mid-run), or None.
    Nothing of profiling is imported unless it is made."""
    p = cfg.profile
    if not (p.enabled and "slowest" in p.ranks and cfg.stragglers.enabled and runtime.world_size > 1):
        return None
    if runtime.rank in p.ranks:
        return None
    window = p.model_copy(
        update={"wait": 0, "warmup": 1, "repeat": 1, "memory_snapshot_step": None, "memory_snapshot_on_oom": False}
    )

    def make() -> Observer:
        from raylane.loop.observe.profiling import StepProfiler

        return StepProfiler(window, runtime.store, runtime.rank, runtime.device)

    return Deferred(make)


def _train_loader(
    cfg: BaseConfig,
    runtime: Runtime,
    pipe: Any,
    data: Any,
    batching: dict[str, Any],
    pp: int,
    startup: dict[str, float],
) -> Any:
    """The training batches on this rank (whole batches under pipeline parallelism); on rank 0,
    with its notes on the epoch and the time to the first batch recorded."""
    train_loader = train_data(
        pipe.train_set, data, **batching, samples_per_step=cfg.train.global_batch, whole_batches=pp > 1
    )
    if runtime.rank == 0:
        _note_small_epoch(pipe.train_set, train_loader, cfg, data.world_size)
        if pp > 1:
            _note_left_out(train_loader, cfg)
        train_loader = FirstBatchClock(train_loader, startup)
    return train_loader


def _evaluator(eval_loader: Any, pipe: Any, runtime: Runtime) -> EvalSets | None:
    """The held-out sets' evaluator ({name: loader}: one per named set), or None without one."""
    if eval_loader is None:
        return None
    return EvalSets(
        eval_loader,
        lambda data: Evaluator(
            data,
            pipe.eval_sums,
            runtime.device,
            runtime.world_size,
            loss_fn=pipe.loss_fn,
            step=pipe.step,
            count=pipe.eval_count,
        ),
    )


def step_trainer(
    cfg: BaseConfig,
    runtime: Runtime,
    pipe: Any,
    model: torch.nn.Module,
    loader: Any,
    optimizer: torch.optim.Optimizer,
    strategy: Strategy,
    throughput: Throughput,
) -> Trainer:
    """A Trainer whose steps alone are taken (autotune times `run_step`): no held-out set, nothing
    reported, and a synchronous Saver for the state a save would copy."""
    reporter = Reporter(is_rank_zero=False, publish=lambda event: None)
    return Trainer(
        model,
        loader,
        optimizer,
        Parts(forward=Forward(pipe.loss_fn, pipe.step, runtime.device), strategy=strategy, throughput=throughput),
        config=cfg,
        runtime=runtime,
        saver=Saver(runtime.store, cfg.checkpoint.model_copy(update={"async_save": False}), reporter),
        reporter=reporter,
    )


def _resume(trainer: Trainer, latest: str, *, own: bool, runtime: Runtime) -> None:
    """`trainer` at the step of checkpoint `latest`: the run's own (`own`), or checkpoint.init_from's."""
    layout = trainer.strategy.layout  # random generators are restored only at the saved one
    state = checkpoint.load(
        latest, trainer.model, trainer.optimizer, rank=runtime.rank, hooks=trainer.hooks.state_dict(), layout=layout
    )
    if not own:  # another run's early stop (a PBT donor's, say) is not this run's
        state.pop("early_stopping", None)
    # By name: a checkpoint on object storage was loaded from a local copy.
    name = checkpoint.checkpoint_name(int(state["step"])) if own else latest
    trainer.resume(state, checkpoint=latest, name=name, layout_line=layout.resumed_from(state))
    if runtime.rank == 0:
        log.info("resuming from step %d (%s)", trainer.step, latest)


def _init_weights(pipe: Any, model: torch.nn.Module, meta: bool) -> None:
    """The pipeline's init_weights, on every rank (it may be a collective: a broadcast from rank 0)."""
    if pipe.init_weights is not None:
        pipe.init_weights(unwrap(model))
    elif meta:
        raise ValueError(
            "the model was built on the meta device (no weights) and the pipeline gives no init_weights "
            "to fill it: give build(cfg)'s Pipeline init_weights=..., e.g. raylane.hf.load_pretrained"
        )


def _note_small_epoch(dataset: Any, loader: Any, cfg: BaseConfig, world_size: int) -> None:
    """One line when the training set is smaller than one step's samples: each epoch is then a
    single, partial step, which a user reading `max_epochs` would not expect."""
    per_step = cfg.train.batch_size * world_size * cfg.train.grad_accum_steps
    rows = getattr(loader, "rows", None)  # a stream's rows per epoch (a list per piece with pyarrow)
    samples = (sum(rows) if isinstance(rows, list) else rows) if is_stream(dataset) else len(dataset)
    if samples is not None and samples < per_step:
        accum = f" x train.grad_accum_steps {cfg.train.grad_accum_steps}" if cfg.train.grad_accum_steps > 1 else ""
        log.warning(
            "the training set has %d samples, fewer than one step's %d (train.batch_size %d x %d "
            "worker%s%s): each epoch is one partial step",
            samples,
            per_step,
            cfg.train.batch_size,
            world_size,
            "s" if world_size > 1 else "",
            accum,
        )


def _note_left_out(loader: Any, cfg: BaseConfig) -> None:
    """One line when a pipeline-parallel epoch leaves out its last, partial batch."""
    order = getattr(loader, "order", None)
    if order is not None and (left := order.num_samples % cfg.train.batch_size):
        log.warning(
            "strategy.pp = %d: each epoch leaves out its last %d samples per data-parallel rank (a pipeline "
            "schedule runs whole batches of train.batch_size = %d)",
            cfg.strategy.pp,
            left,
            cfg.train.batch_size,
        )


def _init_from(cfg: BaseConfig) -> str | None:
    path = cfg.checkpoint.init_from
    if path and (problem := checkpoint.verify(path)):
        raise ValueError(f"checkpoint.init_from = {path!r}: not a valid checkpoint ({problem})")
    return path


def prelude(cfg: BaseConfig, folder: Path | None) -> None:
    """A torchrun rank's, or a one-process run's, start, whatever it runs (training, autotune's
    search): the config's `env:` as this process's own environment, NCCL's flight recorder (into
    the run's `folder`, where its name is known already: raylane.runrecord.run_folder), then the
    process group, which reads both when it starts. Once a process, first: the ranks agree on
    the run's name through the group (raylane.driver.finalize_run). On Ray, the driver ships the
    same variables to each worker before Ray Train starts its group (raylane.onray.placement)."""
    from raylane.config.workerenv import apply_here

    apply_here(cfg.env)
    flight_recorder(cfg, str(folder) if folder else None)
    init_process_group(cfg.scaling.use_gpu, cfg.dist.timeout_s)


def flight_recorder(cfg: BaseConfig, folder: str | None) -> None:
    """NCCL's flight recorder (raylane.loop.observe.hangs), dumping into `folder`'s stacks where
    the run's folder is known; a variable of the user's own wins."""
    for key, value in hangs.flight_recorder_env(cfg.scaling.use_gpu, cfg.dist.flight_recorder_entries, folder).items():
        os.environ.setdefault(key, value)


def local_runtime(cfg: BaseConfig, on_event: Callable[[Event], None]) -> LocalRuntime:
    """This process as one rank: a single process, or a torchrun rank (env vars say which), whose
    `prelude` has run. The caller leaves the process group
    (`raylane.loop.distributed.groups.leave_process_group`)."""
    rank, local_rank, world_size = env_ranks()
    fs, root = filesystem_for(cfg.run.storage_path)
    return LocalRuntime(
        CheckpointStore(f"{root.rstrip('/')}/{cfg.run.name}", fs, rank),
        rank,
        local_rank,
        world_size,
        default_device(cfg.scaling.use_gpu, local_rank),
        publish=on_event if rank == 0 else None,
    )


def launch_local(
    cfg: BaseConfig,
    on_event: Callable[[Event], None],
    metric_logger: Any | None = None,
    held: HeldBatch | None = None,
) -> RunResult:
    """Train as this rank (see local_runtime); `metric_logger`: rank 0's MLflow logger, if any
    (raylane.tracking.runs.rank_zero_logger: the loop itself knows nothing of MLflow); `held`:
    the global batch the launch held on this world (raylane.api.prepare_train)."""
    startup = {"worker_imports": time.time()}
    return run_worker(cfg, local_runtime(cfg, on_event), metric_logger, startup, held=held)
