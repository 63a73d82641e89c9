"""One `raylane autotune` candidate, profiled by every rank at once: a fresh copy of the
pipeline's model, its own wrapping (DDP or FSDP), optimizer and loader, `warmup_steps` and then
`profile_steps` optimizer steps through the Trainer's own `run_step` (so it measures what
training runs), the epoch ends' evaluation and save, and a teardown before the next candidate.
Why an out-of-memory error is agreed, and when: raylane.autotuning.search. Ray-free."""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from raylane.autotuning.agree import Agreement
from raylane.autotuning.costs import eval_seconds, per_step_seconds, save_seconds
from raylane.autotuning.memory import PeakSampler, attempt, error_text, is_oom, memory_now, release, rss
from raylane.autotuning.ranking import summarize
from raylane.config import BaseConfig, apply_values
from raylane.config.autotune import SearchSettings
from raylane.config.batching import hold_global_batch
from raylane.loop.data.loader import first_batch, train_data, worker_options
from raylane.loop.distributed.devices import device_memory_bytes, local_world_size, peak_flops
from raylane.loop.distributed.fsdp import Strategy, materialize, on_meta, prepare_blocks, unwrap
from raylane.loop.distributed.parallelize import estimate_memory, parallelize
from raylane.loop.observe import faults as fault_plans
from raylane.loop.protocols.batches import checked_own_loss, forward_loss, to_device
from raylane.loop.protocols.result import Fit, Outcome
from raylane.loop.protocols.runtime import Runtime
from raylane.loop.run import step_trainer
from raylane.loop.steps import Throughput
from raylane.loop.trainer import Trainer

log = logging.getLogger("raylane")
MAX_WINDOW_STEPS = 100_000


@dataclass
class Live:
    """What a candidate holds while it is profiled, filled in as it is built; cleared before its
    memory is released, so that the teardown's garbage collection frees all of it."""

    model: torch.nn.Module | None = None
    blocks: Any = None  # the pipeline's blocks (modules of `model`), as the copy has them
    strategy: Strategy | None = None
    loader: Any = None
    batches: Iterator[Any] | None = None
    optimizer: torch.optim.Optimizer | None = None
    trainer: Trainer | None = None

    def clear(self) -> None:
        for f in fields(self):
            setattr(self, f.name, None)


class Profiler:
    """Profiles candidates on this rank, one at a time, every rank in step with the others: what
    could fail on one rank alone ends in an agreement (`Agreement.failures`)."""

    def __init__(
        self, cfg: BaseConfig, runtime: Runtime, settings: SearchSettings, agree: Agreement, pipe: Any
    ) -> None:
        self.cfg, self.runtime, self.settings, self.agree, self.pipe = cfg, runtime, settings, agree, pipe
        self.rank, self.world_size, self.device = runtime.rank, runtime.world_size, runtime.device
        self.faults = fault_plans.load(self.rank)
        self.margin = settings.safety_margin
        self._saved_once = False
        # On CPU a candidate's peak is the resident set above this: the allocator keeps the pages
        # earlier candidates freed, so growth from each candidate's own start would read ~0.
        self.rss_at_start = rss()

    def candidate_config(self, values: dict[str, Any]) -> BaseConfig:
        return hold_global_batch(apply_values(self.cfg, values), self.settings.global_batch, "autotune.global_batch")

    def profile(self, values: dict[str, Any], again: bool = False) -> Outcome:
        """One round of a candidate; `again`: a later round (it fitted: no memory estimate)."""
        cfg = self.candidate_config(values)
        live = Live()
        setup = time.perf_counter()
        baseline = memory_now(self.device) if self.device.type == "cuda" else self.rss_at_start
        try:
            out = self._fits(cfg, live, Outcome(values, grad_accum_steps=cfg.train.grad_accum_steps), again)
            if out.status == Fit.OK:
                out = self._measured(cfg, live, out, baseline, setup)
        finally:
            live.clear()
            freed = release(self.device, baseline)
        return out if freed is None else replace(out, unreleased_bytes=freed)

    def _measured(self, cfg: BaseConfig, live: Live, out: Outcome, baseline: int, setup: float) -> Outcome:
        """A candidate that fits on every rank, wrapped and measured."""
        self._wrap(cfg, live)
        if self.agree.distributed:
            # A rank failing from here on may leave a peer in a collective: the group ends.
            return self._measure(cfg, live, out, baseline, setup)
        try:
            return self._measure(cfg, live, out, baseline, setup)
        except Exception as exc:  # one process: nothing waits on it, the search goes on
            status = Fit.OOM if is_oom(exc) else Fit.FAILED
            return replace(out, status=status, error=f"{type(exc).__name__}: {exc}"[:300])

    def _fits(self, cfg: BaseConfig, live: Live, out: Outcome, again: bool) -> Outcome:
        """The candidate built and probed, and what the ranks agreed: `out` still OK when it fits."""
        failed, estimated, prune = self._prepare(cfg, live, estimate=not again)
        out = replace(out, estimated_bytes=estimated)
        oom_rank, failure, prune, estimate = self.agree.failures(failed, prune, estimated or 0)
        if oom_rank is None and failure is None and not prune:
            oom_rank, failure, _, _ = self.agree.failures(self._probe(cfg, live, estimate))
        if failure is not None:  # a candidate this model or machine cannot run (compile without a compiler)
            return replace(out, status=Fit.FAILED, error=f"rank {failure[0]}: {failure[1]}")
        if prune:
            return replace(
                out,
                status=Fit.PRUNED,
                error=f"estimated {estimate / 2**20:.0f} MiB with a {self.margin:.0%} margin does not fit",
            )
        if oom_rank is not None:
            return replace(out, status=Fit.OOM, error=f"out of memory on rank {oom_rank}")
        return out

    def _prepare(self, cfg: BaseConfig, live: Live, estimate: bool = True) -> tuple[bool | str, int | None, bool]:
        """A fresh model and, on rank 0, its memory estimate: no collective yet. Returns (True on
        out of memory, or another error's message; the estimated bytes; whether they prune it)."""
        pipe = self.pipe
        try:
            # One copy: the pipeline's blocks (modules of its model) become the copy's.
            live.model, live.blocks = copy.deepcopy((pipe.model, pipe.blocks))
        except Exception as exc:
            return (True if is_oom(exc) else f"{type(exc).__name__}: {exc}"), None, False
        if self.rank != 0 or not estimate:
            return False, None, False
        try:
            example = _example(pipe, cfg.train.batch_size)
            estimated = estimate_memory(
                live.model, cfg, self.world_size, example, pipe.loss_fn, pipe.step, blocks=live.blocks
            )
        except Exception as exc:  # a model the meta device cannot run: no estimate, nothing pruned
            log.debug("no memory estimate: %s: %s", type(exc).__name__, exc)
            return False, None, False
        need = estimated["ddp" if cfg.strategy.name == "ddp" else "fsdp"]
        budget = device_memory_bytes(self.device, cfg.scaling.device_memory_gb, local_world_size())
        return False, need, need * (1 + self.margin) > budget

    def _probe(self, cfg: BaseConfig, live: Live, estimate: int) -> bool | str:
        """Whether this rank runs out of memory, found without any collective, so that no peer
        waits in one: for DDP (or one process) one micro-batch's forward and backward on the
        unwrapped model, which is what each replica holds; for FSDP, whose forward gathers from
        every rank, a reservation of the estimated bytes. True on out of memory, another error's
        message, or False."""
        pipe = self.pipe
        try:
            batch = _example(pipe, cfg.train.batch_size)
            if self.faults:
                self.faults.before_forward(cfg.train.batch_size)
            assert live.model is not None
            prepare_blocks(
                live.model, cfg, live.blocks
            )  # recompute and compile as trained (a compile error shows here)
            if cfg.strategy.name == "fsdp" and self.world_size > 1:
                if self.device.type == "cuda":
                    torch.empty(estimate, dtype=torch.uint8, device=self.device).fill_(0)  # freed at once
                return False
            model = live.model
            # A meta model (raylane.hf) gets uninitialized memory: the probe measures memory, not the loss.
            model = live.model = materialize(model, self.device) if on_meta(model) else model.to(self.device)
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
            with torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss, output, _ = forward_loss(model, to_device(batch, self.device), pipe.loss_fn, pipe.step)
                (checked_own_loss(output, model) if loss is None else loss).backward()
            for p in model.parameters():
                p.grad = None
            return False
        except Exception as exc:
            if not is_oom(exc):
                return error_text(exc)
            log.debug("rank %d: out of memory at a micro-batch of %d", self.rank, cfg.train.batch_size)
            return True

    def _wrap(self, cfg: BaseConfig, live: Live) -> None:
        """DDP or FSDP (collective: every rank is known to fit by now), the loader, its batches."""
        pipe, model, blocks = self.pipe, live.model, live.blocks
        assert model is not None
        live.model = live.blocks = None  # the wrapped model replaces them
        live.model, live.strategy = parallelize(
            model,
            cfg,
            self.device,
            self.world_size,
            loss_fn=pipe.loss_fn,
            step=pipe.step,
            blocks=blocks,
            blocks_prepared=True,
            ep_plan=pipe.ep_plan,
        )
        del model, blocks
        if pipe.init_weights is not None:  # the weights the run would start from (a collective)
            pipe.init_weights(unwrap(live.model))
        live.loader = train_data(
            pipe.train_set,
            self.runtime,
            batch_size=cfg.train.batch_size,
            seed=cfg.train.seed,
            samples_per_step=cfg.train.global_batch,
            collate_fn=pipe.collate_fn,
            options=worker_options(cfg.loader, self.device),
        )
        live.batches = _forever(live.loader)

    def _measure(self, cfg: BaseConfig, live: Live, out: Outcome, baseline: int, setup: float) -> Outcome:
        """The steps timed, and the epoch ends' evaluation and save spread over them."""
        trainer, throughput = self._trainer(cfg, live)
        assert live.model is not None and live.batches is not None
        groups = _steps(live.batches, cfg.train.grad_accum_steps)
        sampler = PeakSampler(self.device, baseline, live.model)
        # The first step allocates the optimizer's state: an OOM there is local (after the
        # gradients' all-reduce), so it is agreed like the probe's.
        began = trainer.step_clock()
        oom_rank, failure, _, _ = self.agree.failures(attempt(lambda: trainer.run_step(next(groups))))
        if failure is not None:
            return replace(out, status=Fit.FAILED, error=f"rank {failure[0]}: {failure[1]}")
        if oom_rank is not None:
            return replace(out, status=Fit.OOM, error=f"out of memory on rank {oom_rank}")
        sampler.sample()
        step_s = self._warm_up(trainer, groups, sampler, began)
        sizes, times = self._windows(trainer, groups, sampler, step_s)
        sampler.close()
        eval_s, save_s = self._epoch_ends(cfg, live, trainer)
        # Epoch ends, as training pays them, spread over the steps between them.
        per_step = per_step_seconds(cfg, trainer.steps_per_epoch, eval_s, save_s)
        samples = trainer.samples_per_step
        spans = [t + size * per_step for size, t in zip(sizes, times, strict=True)]
        rates = [[size * samples / max(t, 1e-9) for size, t in zip(sizes, spans, strict=True)]]
        measured = summarize(out, rates, [spans])
        speed = measured.samples_per_s or 0.0
        figures = throughput.rates(speed, self.world_size)
        return replace(
            measured,
            rounds=1,
            samples_per_step=samples,
            step_time_s=samples / speed,
            peak_memory_bytes=self.agree.max(sampler.peak),
            profile_s=sum(times),
            setup_s=began - setup,
            eval_s=eval_s,
            save_s=save_s,
            steps_per_epoch=trainer.steps_per_epoch,
            pid=os.getpid(),
            tokens_per_s=figures.get("tokens_per_s"),
            mfu=figures.get("mfu"),
        )

    def _trainer(self, cfg: BaseConfig, live: Live) -> tuple[Trainer, Throughput]:
        """The candidate's optimizer and Trainer, as training builds them (no async save: its
        cost is measured by costs.save_seconds)."""
        from raylane.loop.optim import build_optimizer

        assert live.model is not None and live.strategy is not None  # wrapped (`_wrap`) before it is timed
        optimizer = live.optimizer = build_optimizer(live.model, cfg, self.pipe)  # the pipeline's own state too
        throughput = Throughput(
            self.pipe.tokens_per_sample,
            self.pipe.flops_per_token,
            peak_flops(self.device, cfg.train.precision, cfg.scaling.peak_tflops),
        )
        live.trainer = step_trainer(
            cfg, self.runtime, self.pipe, live.model, live.loader, optimizer, live.strategy, throughput
        )
        return live.trainer, throughput

    def _warm_up(self, trainer: Trainer, groups: Iterator[list[Any]], sampler: PeakSampler, began: float) -> float:
        """The rest of the warm-up steps (the first was agreed): the seconds of a step."""
        warmup = self.settings.warmup_steps
        warmed = trainer.step_clock()
        for _ in range(warmup - 1):
            trainer.run_step(next(groups))
            sampler.sample()
        return (trainer.step_clock() - warmed) / (warmup - 1) if warmup > 1 else warmed - began

    def _windows(
        self, trainer: Trainer, groups: Iterator[list[Any]], sampler: PeakSampler, step_s: float
    ) -> tuple[list[int], list[float]]:
        """(steps, seconds) of each measured window. A window lasts at least `min_window_s` (by
        the warm-up's step time; the ranks agree on the largest count): tiny steps on a busy
        machine are otherwise timed within one slice of the scheduler."""
        sizes = _window_sizes(self.settings.profile_steps, self.settings.windows)
        needed = math.ceil(self.settings.min_window_s / max(step_s, 1e-6))
        needed = self.agree.max(min(needed, MAX_WINDOW_STEPS))
        sizes = [max(size, needed) for size in sizes]
        times = []
        mark = trainer.step_clock()
        for size in sizes:
            for _ in range(size):
                trainer.run_step(next(groups))
                sampler.sample()
            ended = trainer.step_clock()
            times.append(ended - mark)
            mark = ended
        return sizes, times

    def _epoch_ends(self, cfg: BaseConfig, live: Live, trainer: Trainer) -> tuple[float, float]:
        """(seconds of one evaluation, of one checkpoint save), as the candidate's run pays them."""
        assert live.model is not None and live.optimizer is not None
        model, optimizer, clock = live.model, live.optimizer, trainer.step_clock
        eval_s = eval_seconds(cfg, model, self.pipe, self.runtime, clock)
        state = trainer.state_dict()
        if not self._saved_once:  # the process's first save imports and warms up what the rest reuse
            save_seconds(cfg, model, optimizer, state, self.rank, clock, self.agree.group)
            self._saved_once = bool(cfg.checkpoint.every_n_epochs or cfg.checkpoint.every_n_steps)
        return eval_s, save_seconds(cfg, model, optimizer, state, self.rank, clock, self.agree.group)


def _example(pipe: Any, batch_size: int) -> Any:
    return first_batch(pipe.train_set, batch_size, pipe.collate_fn)


def _window_sizes(steps: int, windows: int) -> list[int]:
    """`steps` split into `windows` windows as even as can be (the larger first)."""
    windows = max(1, min(windows, steps))
    return [steps // windows + (i < steps % windows) for i in range(windows)]


def _forever(loader: Any) -> Iterator[Any]:
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def _steps(batches: Iterator[Any], accum: int) -> Iterator[list[Any]]:
    while True:
        yield [next(batches) for _ in range(accum)]
