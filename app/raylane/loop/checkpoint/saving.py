"""A run's checkpoints from the training loop's side: when to wait, what to tell the driver.

With `checkpoint.async_save` the loop only takes references to the state at a step boundary.
A background thread copies it into reused CPU buffers (raylane.loop.checkpoint.staging.Stager) while
the next step's forward and backward run, which only read it: the loop waits for the copy only
before it changes the state (`wait_staged`: before the optimizer step, or before the forward
when the model has buffers a forward may update). The same thread then does everything else,
DCP's planning collectives, the files, their checksums, the manifest and retention, with a
process group of its own: the commit is agreed by every rank there, off the training thread,
and the loop learns the outcome later, the same on every rank. At most one save is in flight;
the next save, the end of the run and a stop wait for it."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from raylane.config import CheckpointSection
from raylane.loop.checkpoint import writing
from raylane.loop.checkpoint.agree import CheckpointSaveError, collectives_on, describe, save_errors
from raylane.loop.checkpoint.aliases import aliases
from raylane.loop.checkpoint.frozen import records_of
from raylane.loop.checkpoint.rng import rng_state
from raylane.loop.checkpoint.staging import LiveState, Stager
from raylane.loop.checkpoint.state import live_state, partial, replicated
from raylane.loop.checkpoint.storage import CheckpointStore

log = logging.getLogger("raylane.checkpoint")


# What a save tells and asks of the loop above it (raylane.loop.reporting.Reporter and
# raylane.loop.observe.faults.FaultPlan), as interfaces: checkpoints sit below both.
class SaveReporter(Protocol):
    def on_checkpoint(
        self, *, step: int, location: str, epoch: int, metrics: dict[str, float], speed: dict[str, float] | None = None
    ) -> None: ...

    def on_checkpoint_failed(self, *, step: int, error: str) -> None: ...


class SaveFaults(Protocol):
    def before_save(self, step: int, path: str) -> None: ...


@dataclass
class _SaveJob:
    """One save, as the training thread hands it to the writer: taken at the step boundary,
    written and committed later (on the writer thread when asynchronous)."""

    path: str
    state: dict[str, Any]  # references to the live state (a copy once staged), or {} on ranks that write none
    train_state: dict[str, Any]
    rng: dict[str, Any]  # this rank's generators at the step (raylane.loop.checkpoint.rng)
    error: str | None  # this rank's failure so far, which the commit makes every rank's
    replicated: bool
    aliases: dict[str, str]
    records: dict[str, Any]
    part: bool  # a partial model (raylane.loop.checkpoint.state.partial)
    outcome: Future  # the location committed, or the CheckpointSaveError every rank agreed on


class Saver:
    """A run's checkpoints from the training loop's side: `save` at a step boundary, `settle`
    to learn the outcome (the same on every rank), at most one save in flight. It writes through
    raylane.loop.checkpoint.writing and commits into `store` (where the run's checkpoints live
    and which are kept), reports through `reporter`, and calls `on_committed` (the hooks'
    on_checkpoint) once a save is committed."""

    def __init__(
        self,
        store: CheckpointStore,
        cfg: CheckpointSection,
        reporter: SaveReporter,
        *,
        group: Any = None,
        faults: SaveFaults | None = None,
    ) -> None:
        self.store, self.cfg, self.reporter, self.group, self.faults = store, cfg, reporter, group, faults
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        # Background collectives on the loop's own group could interleave with its all-reduces.
        self.asynchronous = cfg.async_save and (group is not None or not distributed)
        if cfg.async_save and not self.asynchronous:
            log.warning("checkpoint.async_save without a process group for saves: saving synchronously")
        self._stager = Stager()
        self._live = LiveState()
        self._in_flight: tuple[dict[str, Any], Future] | None = None  # (train state, outcome)
        self._jobs: queue.SimpleQueue[_SaveJob | None] | None = None
        self._staged = threading.Event()
        self._staged.set()
        self.last_checkpoint: str | None = None
        self.failed = 0
        # Called with (step, location) once a save is committed, on every rank (hooks' on_checkpoint).
        self.on_committed: Callable[[int, str], None] | None = None

    def busy(self) -> bool:
        """This rank's save in flight has not finished (its commit included)."""
        return self._in_flight is not None and not self._in_flight[1].done()

    def unsettled(self) -> bool:
        return self._in_flight is not None

    def staging(self) -> bool:
        """The save in flight still reads the live state: do not change it yet."""
        return not self._staged.is_set()

    def wait_staged(self) -> None:
        self._staged.wait()

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_state: dict[str, Any],
        hooks: dict[str, Any] | None = None,
    ) -> None:
        """Collective. Returns once the state is staged (async) or committed (sync). `hooks`: the
        pipeline's hooks' states by key (raylane.loop.protocols.hooks), saved with the model's."""
        self.settle()  # at most one save in flight, and the staging buffers are free again
        if hooks:
            train_state = {**train_state, "hooks": sorted(hooks)}  # what a load asks the checkpoint for
        step = int(train_state["step"])
        path, error = self._new_dir(step)
        if self.faults and error is None:
            self.faults.before_save(step, path)
        rng, state = rng_state(), {}
        whole = replicated(model)
        try:
            if error is None and (self.store.rank == 0 or not whole):  # other ranks of DDP write no state
                state = (
                    self._live.take(model, optimizer, live_state) if whole else live_state(model, optimizer)
                )  # references, and plain values copied
        except save_errors() as exc:  # the write agrees on it with every rank
            error = describe(exc, self.store.rank)
        if hooks and state:
            state = {**state, "hooks": hooks}
        job = _SaveJob(
            path=path,
            state=state,
            train_state=train_state,
            rng=rng,
            error=error,
            replicated=whole,
            aliases=aliases(model),
            records=records_of(model),
            part=partial(model),
            outcome=Future(),
        )
        self._in_flight = (train_state, job.outcome)
        if self.asynchronous:
            self._staged.clear()
            self._writer().put(job)
        else:
            self._write_and_commit(job)
            self.settle()

    def _new_dir(self, step: int) -> tuple[str, str | None]:
        """(where this rank writes the save at `step`, this rank's failure to make it or None). A
        folder that cannot be made (a read-only or full file system) is the save's failure like a
        file that cannot be written: this rank still takes part in the write's collectives, every
        rank learns of it at the commit, and checkpoint.on_error decides."""
        try:
            return self.store.new_dir(step), None
        except OSError as exc:
            return self.store.unmade_dir(step), describe(exc, self.store.rank)

    def _writer(self) -> queue.SimpleQueue[_SaveJob | None]:
        """The one thread that writes this run's saves, started at the first. A thread per save
        made every save wait for its thread to be scheduled (Thread.start waits until it runs):
        ~1 ms of each epoch end on 2 busy cores (bench B9)."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            # daemon: a failed peer must not hold up exit
            threading.Thread(target=self._write_loop, args=(self._jobs,), name="raylane-saver", daemon=True).start()
        return self._jobs

    def _write_loop(self, jobs: queue.SimpleQueue[_SaveJob | None]) -> None:
        while (job := jobs.get()) is not None:
            self._write_and_commit(job)

    def close(self) -> None:
        """After the last settle(): the writer thread ends."""
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None

    def _write_and_commit(self, job: _SaveJob) -> None:
        ck, state, error = self.cfg, job.state, job.error
        try:
            if self.asynchronous:
                try:
                    state = self._stager.stage(state) if error is None else state
                except save_errors() as exc:
                    error = describe(exc, self.store.rank)
                finally:
                    self._staged.set()
            with collectives_on(self.group if self.asynchronous else None):
                try:
                    writing.write(
                        job.path,
                        state,
                        job.train_state,
                        rank=self.store.rank,
                        rng=job.rng,
                        error=error,
                        replicated=job.replicated,
                        aliases=job.aliases,
                        records=job.records,
                        part=job.part,
                    ).commit()
                    step = int(job.train_state["step"])
                    best = (ck.best_metric, ck.best_mode)
                    job.outcome.set_result(
                        self.store.commit(job.path, step, keep=ck.keep, keep_best=ck.keep_best, best=best)
                    )
                except CheckpointSaveError as exc:
                    self.store.discard(job.path)
                    job.outcome.set_result(exc)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the training thread by settle()
            job.outcome.set_exception(exc)

    @contextlib.contextmanager
    def settled_on_failure(self, timeout_s: float) -> Iterator[None]:
        """Around the training loop: should it fail (a non-finite loss with train.on_nan: stop,
        an error in the user's code), the save in flight still commits, and is announced like
        any other (the run's newest checkpoint is then the one it names), waited for at most
        `timeout_s`. Its own errors give way to the run's."""
        try:
            yield
        except Exception:
            if self._in_flight is not None:
                try:
                    self._in_flight[1].result(timeout=timeout_s)
                    self.settle()
                except Exception as exc:  # noqa: BLE001 - the run's error is the one to report
                    log.info("the checkpoint in flight when the run failed was not committed: %s", exc)
            raise

    def settle(self) -> None:
        """Wait for the save in flight, if any, and act on its outcome: the same on every rank,
        for the commit was agreed by all."""
        if self._in_flight is None:
            return
        (state, outcome), self._in_flight = self._in_flight, None
        step = int(state["step"])
        result = outcome.result()  # a failure other than the save's own is the run's
        if isinstance(result, CheckpointSaveError):
            if self.cfg.on_error == "fail":
                raise result
            self.failed += 1
            self.reporter.on_checkpoint_failed(step=step, error=f"{result} (checkpoint.on_error: warn)")
            return
        self.last_checkpoint = result
        self.reporter.on_checkpoint(
            step=step,
            location=result,
            epoch=state["epoch"],
            metrics=state.get("eval_metrics") or {},
            speed=state.get("speed_metrics") or {},
        )
        if self.on_committed is not None:
            self.on_committed(step, result)

    # -- the cadence ---------------------------------------------------------------------------

    def due(self, step: int, *, epoch_end: bool, stopping: bool, epochs: int = 0) -> bool:
        """Whether the state at `step` is to be saved, as torchtitan's checkpointer decides: at a
        stop (the run's last step, a preemption, an early stop, a max_steps stop mid-epoch),
        always; every `checkpoint.every_n_steps` steps, at an epoch end too; and at the end of every
        `checkpoint.every_n_epochs` epochs (`epochs`: the epochs ended). The Trainer asks at each step, and again at an
        epoch end or a stop once its evaluation is done: a step that ends an epoch or the run is
        saved then, with its metrics, not before."""
        if stopping:
            return True
        by_steps = self.cfg.every_n_steps > 0 and step % self.cfg.every_n_steps == 0
        by_epochs = epoch_end and self.cfg.every_n_epochs > 0 and epochs % self.cfg.every_n_epochs == 0
        return by_steps or by_epochs
