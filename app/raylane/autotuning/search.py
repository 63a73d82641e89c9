"""`raylane autotune` on the ranks: one process group profiles every candidate configuration.

Start-up (processes, process group, imports, the pipeline's data) is paid once. Each candidate
then gets a fresh copy of the pipeline's model, its own wrapping (DDP or FSDP), optimizer and
loader, runs `warmup_steps` and `profile_steps` optimizer steps through the Trainer's own
`run_step` (so it measures what training runs), and is torn down before the next one.

Out of memory is agreed, not left to hang a collective. A candidate's model is built and its
memory estimated (rank 0 prunes what cannot fit) before any collective; then one micro-batch's
forward and backward run without gradient sync (no collective under DDP). Each of these ends
with one all-reduce of "any rank out of memory?", so a candidate that does not fit on one rank
is infeasible on all of them. An OOM later, inside a collective, can still hang the group: the
run's dist.timeout_s ends it, and a relaunch (or Ray's restart) replays the search's record and
marks that candidate failed instead of trying it again.

Rank 0 plans (`plan`, a generator: the next candidate depends on the last outcomes) and sends
each candidate to every rank. Ray-free, like the rest of the loop."""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from raylane.autotuning.costs import eval_seconds, per_step_seconds, save_seconds
from raylane.autotuning.order import Outcome, plan, read_record
from raylane.autotuning.ranking import merge, next_round, summarize
from raylane.batching import GlobalBatch, hold_global_batch
from raylane.config import BaseConfig, apply_values
from raylane.loop import faults as fault_plans
from raylane.loop import usercode
from raylane.loop.batches import checked_own_loss, forward_loss, to_device
from raylane.loop.data import first_batch, train_data, worker_options
from raylane.loop.devices import device_memory_bytes, local_world_size, peak_flops
from raylane.loop.events import Candidate, End, Event, Round, SearchStart
from raylane.loop.parallel import estimate_memory, materialize, on_meta, parallelize, prepare_blocks, unwrap
from raylane.loop.run import step_trainer
from raylane.loop.runtime import Runtime
from raylane.loop.steps import Throughput
from raylane.loop.trainer import Trainer

log = logging.getLogger("raylane")
MAX_WINDOW_STEPS = 100_000


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(exc)


# -- profiling one candidate (every rank) --------------------------------------------------------


class Search:
    def __init__(
        self, cfg: BaseConfig, runtime: Runtime, settings: dict[str, Any], publish: Callable[[Event], None]
    ) -> None:
        self.cfg, self.runtime, self.settings, self.publish = cfg, runtime, settings, publish
        self.rank, self.world_size, self.device = runtime.rank, runtime.world_size, runtime.device
        self.distributed = dist.is_initialized() and self.world_size > 1
        # Agreements run on gloo, off the training group (a CUDA stream never delays them).
        self.group = dist.new_group(backend="gloo") if self.distributed and cfg.scaling.use_gpu else None
        self.faults = fault_plans.load(self.rank)
        self.held = GlobalBatch(**settings["global_batch"])
        self.margin = float(settings.get("safety_margin", 0.1))
        self._saved_once = False
        self.record_path = Path(settings["record"]) if settings.get("record") else None
        # What an earlier launch's record must match to be replayed: the config and the space.
        same = {k: v for k, v in cfg.flat().items() if not k.startswith("run.")}
        self.fingerprint = hashlib.sha256(
            json.dumps(
                [
                    same,
                    settings["space"],
                    settings["global_batch"],
                    settings["warmup_steps"],
                    settings["profile_steps"],
                    settings.get("windows", 1),
                    settings.get("min_window_s", 0),
                ],
                sort_keys=True,
                default=str,
            ).encode()
        ).hexdigest()[:16]

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.pipe = pipe = usercode.build_pipeline(self.cfg)  # the data, and the model every candidate copies
        if not on_meta(pipe.model):  # a meta model gets memory in each candidate
            pipe.model.to("cpu")
        # Each candidate's teardown collects garbage: leave what lives the whole search (imports,
        # the data) out of those collections (a full one took ~0.7 s on 2 busy cores).
        gc.collect()
        gc.freeze()
        # On CPU a candidate's peak is the resident set above this: the allocator keeps the pages
        # earlier candidates freed, so growth from each candidate's own start would read ~0.
        self.rss_at_start = _rss()
        if self.rank == 0:
            self.publish(SearchStart(time_unix=time.time()))
        planner = plan(self.settings["space"], self.settings.get("own")) if self.rank == 0 else None
        replay, rounds_replay = self._recorded() if self.rank == 0 else ([], [])
        deadline = started + self.settings["budget_s"] if self.settings.get("budget_s") else None
        outcome: Outcome | None = None
        outcomes: list[Outcome] = []
        while True:
            message = self._next(planner, outcome, replay, deadline, len(outcomes)) if self.rank == 0 else None
            message = self._broadcast(message)
            if message is None:
                break
            if message.get("replayed"):
                outcome = {**message["replayed"], "replayed": True}
            else:
                self._mark_started(message["values"])
                outcome = self.profile(message["values"], pipe)
                self._record(outcome)
            outcomes.append(outcome)
            if self.rank == 0:
                self.publish(
                    Candidate(index=len(outcomes) - 1, replayed=bool(outcome.get("replayed")), outcome=dict(outcome))
                )
        self._measure_again(outcomes, rounds_replay, deadline)
        result = {
            "candidates": outcomes,
            "wall_s": time.perf_counter() - started,
            "world_size": self.world_size,
            "estimate_margin": self.margin,
            "device": self.device.type,
        }
        if self.rank == 0:
            self.publish(End(time_unix=time.time(), result=result))
        gc.unfreeze()
        return result

    def _measure_again(
        self, outcomes: list[Outcome], replay: list[tuple[int, Outcome]], deadline: float | None
    ) -> None:
        """Rounds after the search order's: the candidates whose ranking against the leader is
        not clear yet (search_ranking.next_round) are measured once more each, the leader first,
        until it is clear, or each has `max_rounds`, or the budget is spent."""
        queue: list[int] = []
        while True:
            message = self._next_round(outcomes, queue, replay, deadline) if self.rank == 0 else None
            message = self._broadcast(message)
            if message is None:
                return
            index = message["index"]
            if message.get("replayed"):
                again = message["replayed"]
            else:
                self._record({"started_round": index})
                again = self.profile(message["values"], self.pipe, again=True)
                self._record({"round_of": index, "outcome": again})
            outcomes[index] = merge(outcomes[index], again)
            if self.rank == 0:
                self.publish(
                    Round(
                        index=index,
                        rounds=outcomes[index].get("rounds"),
                        replayed=bool(message.get("replayed")),
                        outcome=dict(outcomes[index]),
                    )
                )

    def _next_round(
        self, outcomes: list[Outcome], queue: list[int], replay: list[tuple[int, Outcome]], deadline: float | None
    ) -> dict[str, Any] | None:
        if deadline and time.perf_counter() > deadline:
            return None
        if not queue:
            queue.extend(
                next_round(
                    outcomes,
                    self.settings.get("own") or {},
                    self.settings["space"],
                    min_rounds=self.settings.get("min_rounds", 1),
                    max_rounds=self.settings.get("max_rounds", 1),
                )
            )
            if not queue:
                return None
        index = queue.pop(0)
        message = {"index": index, "values": outcomes[index]["values"]}
        if replay and replay[0][0] == index:
            return {**message, "replayed": replay.pop(0)[1]}
        replay.clear()  # the earlier launch went another way from here
        return message

    def _next(self, planner, outcome, replay, deadline, done: int) -> dict[str, Any] | None:
        if done >= self.settings["max_candidates"] or (deadline and time.perf_counter() > deadline):
            return None
        try:
            values = planner.send(outcome) if outcome is not None else next(planner)
        except StopIteration:
            return None
        if done < len(replay):
            recorded = replay[done]
            if recorded["values"] == values:
                return {"values": values, "replayed": recorded}
        return {"values": values}

    def _broadcast(self, message: Any) -> Any:
        if not self.distributed:
            return message
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _agree(
        self, failed: bool | str = False, prune: bool = False, estimate: int = 0
    ) -> tuple[int | None, tuple[int, str] | None, bool, int]:
        """One small all-reduce: (the highest rank out of memory, or None; (a rank whose step
        raised something else, its message), or None; whether rank 0 pruned it; rank 0's
        estimate). `failed`: True for out of memory, or another error's message."""
        oom, error = failed is True, failed if isinstance(failed, str) else None
        if not self.distributed:
            return (self.rank if oom else None), ((self.rank, error) if error else None), prune, estimate
        rank0 = self.rank == 0
        flags = torch.tensor(
            [
                float(self.rank + 1 if oom else 0),
                float(self.rank + 1 if error else 0),
                float(prune and rank0),
                float(estimate if rank0 else 0),
            ],
            dtype=torch.float64,
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        oom_rank, error_rank = int(flags[0].item()) - 1, int(flags[1].item()) - 1
        failure = None
        if error_rank >= 0:  # its message, from the rank that has it
            box = [error]
            dist.broadcast_object_list(box, src=error_rank, group=self.group)
            failure = (error_rank, box[0])
        return (oom_rank if oom_rank >= 0 else None), failure, flags[2].item() > 0, int(flags[3].item())

    def candidate_config(self, values: dict[str, Any]) -> BaseConfig:
        return hold_global_batch(apply_values(self.cfg, values), self.held, "autotune.global_batch")

    def profile(self, values: dict[str, Any], pipe: Any, again: bool = False) -> Outcome:
        """One round of a candidate; `again`: a later round (it fitted: no memory estimate)."""
        cfg = self.candidate_config(values)
        out: Outcome = {
            "values": values,
            "status": "ok",
            "grad_accum_steps": cfg.train.grad_accum_steps,
            "samples_per_s": None,
            "peak_memory_bytes": None,
            "estimated_bytes": None,
            "error": None,
        }
        live: dict[str, Any] = {}
        setup = time.perf_counter()
        baseline = _memory_now(self.device) if self.device.type == "cuda" else self.rss_at_start
        try:
            failed, prune = self._prepare(cfg, pipe, live, out, estimate=not again)
            oom_rank, failure, prune, estimate = self._agree(failed, prune, out["estimated_bytes"] or 0)
            if oom_rank is None and failure is None and not prune:
                oom_rank, failure, _, _ = self._agree(self._probe(cfg, pipe, live, estimate))
            if failure is not None:  # a candidate this model or machine cannot run (compile without a compiler)
                out.update(status="failed", error=f"rank {failure[0]}: {failure[1]}")
                return out
            if prune:
                out.update(
                    status="pruned",
                    error=f"estimated {estimate / 2**20:.0f} MiB with a {self.margin:.0%} margin does not fit",
                )
                return out
            if oom_rank is not None:
                out.update(status="oom", error=f"out of memory on rank {oom_rank}")
                return out
            self._wrap(cfg, pipe, live)
            if self.distributed:  # a rank failing from here on may leave a peer in a collective: the group ends
                out.update(self._measure(cfg, live, baseline, setup))
                return out
            try:
                out.update(self._measure(cfg, live, baseline, setup))
            except Exception as exc:  # one process: nothing waits on it, the search goes on
                out.update(status="oom" if _is_oom(exc) else "failed", error=f"{type(exc).__name__}: {exc}"[:300])
            return out
        finally:
            live.clear()
            freed = _release(self.device, baseline)
            if freed is not None:
                out["unreleased_bytes"] = freed

    def _prepare(
        self, cfg: BaseConfig, pipe: Any, live: dict[str, Any], out: Outcome, estimate: bool = True
    ) -> tuple[bool | str, bool]:
        """A fresh model and, on rank 0, its memory estimate: no collective yet. Returns (True on
        out of memory, or another error's message; whether the estimate prunes it)."""
        try:
            # One copy: the pipeline's blocks (modules of its model) become the copy's.
            live["model"], live["blocks"] = copy.deepcopy((pipe.model, pipe.blocks))
        except Exception as exc:
            return (True if _is_oom(exc) else f"{type(exc).__name__}: {exc}"), False
        if self.rank != 0 or not estimate:
            return False, False
        try:
            example = _example(pipe, cfg.train.batch_size)
            estimate = estimate_memory(
                live["model"], cfg, self.world_size, example, pipe.loss_fn, pipe.step, blocks=live["blocks"]
            )
        except Exception as exc:  # a model the meta device cannot run: no estimate, nothing pruned
            log.debug("no memory estimate: %s: %s", type(exc).__name__, exc)
            return False, False
        need = estimate["ddp" if cfg.strategy.name == "ddp" else "fsdp"]
        budget = device_memory_bytes(self.device, cfg.scaling.device_memory_gb, local_world_size())
        out["estimated_bytes"] = need
        return False, need * (1 + self.margin) > budget

    def _probe(self, cfg: BaseConfig, pipe: Any, live: dict[str, Any], estimate: int) -> bool | str:
        """Whether this rank runs out of memory, found without any collective, so that no peer
        waits in one: for DDP (or one process) one micro-batch's forward and backward on the
        unwrapped model, which is what each replica holds; for FSDP, whose forward gathers from
        every rank, a reservation of the estimated bytes. True on out of memory, another error's
        message, or False."""
        try:
            batch = _example(pipe, cfg.train.batch_size)
            if self.faults:
                self.faults.before_forward(cfg.train.batch_size)
            prepare_blocks(
                live["model"], cfg, live["blocks"]
            )  # recompute and compile as trained (a compile error shows here)
            if cfg.strategy.name == "fsdp" and self.world_size > 1:
                if self.device.type == "cuda":
                    torch.empty(estimate, dtype=torch.uint8, device=self.device).fill_(0)  # freed at once
                return False
            model = live["model"]
            # A meta model (raylane.hf) gets uninitialized memory: the probe measures memory, not the loss.
            model = live["model"] = materialize(model, self.device) if on_meta(model) else model.to(self.device)
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
            with torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss, output, _ = forward_loss(model, to_device(batch, self.device), pipe.loss_fn, pipe.step)
                (checked_own_loss(output, model) if loss is None else loss).backward()
            for p in model.parameters():
                p.grad = None
            return False
        except Exception as exc:
            if not _is_oom(exc):
                return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            log.debug("rank %d: out of memory at a micro-batch of %d", self.rank, cfg.train.batch_size)
            return True

    def _wrap(self, cfg: BaseConfig, pipe: Any, live: dict[str, Any]) -> None:
        """DDP or FSDP (collective: every rank is known to fit by now), the loader, its batches."""
        model, strategy = parallelize(
            live.pop("model"),
            cfg,
            self.device,
            self.world_size,
            loss_fn=pipe.loss_fn,
            step=pipe.step,
            blocks=live.pop("blocks"),
            blocks_prepared=True,
        )
        live["model"], live["strategy"] = model, strategy
        if pipe.init_weights is not None:  # the weights the run would start from (a collective)
            pipe.init_weights(unwrap(model))
        live["loader"] = loader = train_data(
            pipe.train_set,
            self.runtime,
            batch_size=cfg.train.batch_size,
            seed=cfg.train.seed,
            samples_per_step=cfg.train.global_batch,
            collate_fn=pipe.collate_fn,
            options=worker_options(cfg.loader, self.device),
        )
        live["batches"] = _forever(loader)

    def _measure(self, cfg: BaseConfig, live: dict[str, Any], baseline: int, setup: float) -> dict[str, Any]:
        from raylane.loop.optim import build_optimizer

        model = live["model"]
        optimizer = live["optimizer"] = build_optimizer(model, cfg, self.pipe)  # the pipeline's own state too
        throughput = Throughput(
            self.pipe.tokens_per_sample,
            self.pipe.flops_per_token,
            peak_flops(self.device, cfg.train.precision, cfg.scaling.peak_tflops),
        )
        trainer = live["trainer"] = step_trainer(
            cfg, self.runtime, self.pipe, model, live["loader"], optimizer, live["strategy"], throughput
        )
        groups = _steps(live["batches"], cfg.train.grad_accum_steps)
        sampler = _PeakSampler(self.device, baseline, model)
        # The first step allocates the optimizer's state: an OOM there is local (after the
        # gradients' all-reduce), so it is agreed like the probe's.
        began = trainer.step_clock()
        oom_rank, failure, _, _ = self._agree(_attempt(lambda: trainer.run_step(next(groups))))
        if failure is not None:
            return {"status": "failed", "error": f"rank {failure[0]}: {failure[1]}"}
        if oom_rank is not None:
            return {"status": "oom", "error": f"out of memory on rank {oom_rank}"}
        sampler.sample()
        warmed = trainer.step_clock()
        for _ in range(self.settings["warmup_steps"] - 1):
            trainer.run_step(next(groups))
            sampler.sample()
        step_s = (
            (trainer.step_clock() - warmed) / (self.settings["warmup_steps"] - 1)
            if self.settings["warmup_steps"] > 1
            else warmed - began
        )
        sizes, times = self._windows(trainer, groups, sampler, step_s)
        sampler.close()
        # Epoch ends, as training pays them, spread over the steps between them.
        clock = trainer.step_clock
        eval_s = eval_seconds(cfg, model, self.pipe, self.runtime, clock)
        state = trainer.state_dict()
        if not self._saved_once:  # the process's first save imports and warms up what the rest reuse
            save_seconds(cfg, model, optimizer, state, self.rank, clock, self.group)
            self._saved_once = bool(cfg.checkpoint.every_n_epochs or cfg.checkpoint.every_n_steps)
        save_s = save_seconds(cfg, model, optimizer, state, self.rank, clock, self.group)
        per_step = per_step_seconds(cfg, trainer.steps_per_epoch, eval_s, save_s)
        samples = trainer.samples_per_step
        spans = [t + size * per_step for size, t in zip(sizes, times, strict=True)]
        measured = summarize([[size * samples / max(t, 1e-9) for size, t in zip(sizes, spans, strict=True)]], [spans])
        return {
            **measured,
            "rounds": 1,
            "samples_per_step": samples,
            "step_time_s": samples / measured["samples_per_s"],
            "peak_memory_bytes": self._max(sampler.peak),
            "profile_s": sum(times),
            "setup_s": began - setup,
            "eval_s": eval_s,
            "save_s": save_s,
            "steps_per_epoch": trainer.steps_per_epoch,
            "pid": os.getpid(),
            **throughput.rates(measured["samples_per_s"], self.world_size),
        }

    def _windows(
        self, trainer: Trainer, groups: Iterator[list[Any]], sampler: _PeakSampler, step_s: float
    ) -> tuple[list[int], list[float]]:
        """(steps, seconds) of each measured window. A window lasts at least `min_window_s` (by
        the warm-up's step time; the ranks agree on the largest count): tiny steps on a busy
        machine are otherwise timed within one slice of the scheduler."""
        sizes = _window_sizes(self.settings["profile_steps"], self.settings.get("windows", 1))
        needed = math.ceil(self.settings.get("min_window_s", 0) / max(step_s, 1e-6))
        needed = self._max(min(needed, MAX_WINDOW_STEPS))
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

    def _max(self, value: int) -> int:
        if not self.distributed:
            return int(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    # -- the search's record, for a relaunch -------------------------------------------------

    def _recorded(self) -> tuple[list[Outcome], list[tuple[int, Outcome]]]:
        """What an earlier launch of this search measured: each candidate's first outcome, and
        the later rounds in order, as (candidate index, that round's outcome). A candidate it
        started but never finished (its group died) is recorded failed, so it is not tried
        again; a round that never finished ends that candidate's rounds."""
        if self.record_path is None or not self.record_path.exists():
            return [], []
        done, rounds, started, round_started = read_record(self.record_path, self.fingerprint)
        died = "the worker group died while profiling it"
        if started is not None:
            failed = {
                "values": started,
                "status": "failed",
                "samples_per_s": None,
                "peak_memory_bytes": None,
                "estimated_bytes": None,
                "error": died,
            }
            self._append(failed)
            done.append(failed)
        if round_started is not None:
            self._append({"round_of": round_started, "outcome": {"status": "failed", "error": died}})
            rounds.append((round_started, {"status": "failed", "error": died}))
        return done, rounds

    def _mark_started(self, values: dict[str, Any]) -> None:
        if self.rank == 0:
            self._append({"started": values})

    def _record(self, outcome: Outcome) -> None:
        if self.rank == 0:
            self._append(outcome)

    def _append(self, entry: dict[str, Any]) -> None:
        if self.record_path is not None:
            self.record_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.record_path, "a") as f:
                f.write(json.dumps({**entry, "fingerprint": self.fingerprint}) + "\n")


def run_search(cfg: BaseConfig, runtime: Runtime, settings: dict[str, Any]) -> dict[str, Any]:
    """The whole search on this rank (every rank calls it); rank 0 publishes a `candidate` event
    per outcome and the result as the `end` event."""
    return Search(cfg, runtime, settings, runtime.publish if runtime.rank == 0 else (lambda e: None)).run()


def _attempt(step: Callable[[], Any]) -> bool | str:
    """Run `step`: False, or True on out of memory, or another error's message."""
    try:
        step()
        return False
    except Exception as exc:
        return True if _is_oom(exc) else f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _example(pipe: Any, batch_size: int):

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


def _memory_now(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return _rss()


def _rss() -> int:
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class _PeakSampler:
    """A candidate's peak memory above what was in use before it: the device's peak on GPU; on
    CPU the resident set, sampled at the end of each forward (activations alive) and each step."""

    def __init__(self, device: torch.device, baseline: int, model: torch.nn.Module) -> None:
        self.device, self.baseline, self.peak = device, baseline, 0
        self._hook = None if device.type == "cuda" else unwrap(model).register_forward_hook(lambda *_: self.sample())

    def sample(self) -> None:
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) - self.baseline)
        else:
            self.peak = max(self.peak, _rss() - self.baseline)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()


def _release(device: torch.device, baseline: int) -> int | None:
    """Free what the candidate held; on GPU, the bytes still allocated above `baseline` after
    that (None on CPU, whose allocator keeps freed pages)."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return max(torch.cuda.memory_allocated(device) - baseline, 0)
