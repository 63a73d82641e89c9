"""Held-out evaluation: the pipeline's metric sums over this rank's share of the held-out data,
summed over every rank and divided by the number of samples: exact over all ranks, whatever
their shares (`Evaluator`, one per named set: `EvalSets`); and the Trainer's evaluations, when
each is due and what follows it, composed (`Evaluation`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from raylane.config import TrainSection
from raylane.errors import RaylaneError
from raylane.loop.distributed.groups import all_reduce_max, all_reduce_sums
from raylane.loop.distributed.pipeline_parallel import PipelineModel
from raylane.loop.early_stop import EarlyStopping
from raylane.loop.protocols.batches import batch_size, call_model, checked_own_loss, form_of, forward_loss, to_device
from raylane.loop.protocols.hooks import Hooks
from raylane.loop.reporting import Reporter

log = logging.getLogger("raylane")
SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # a named held-out set
FAILED = "raylane.failed"  # a sum every rank reduces: how many ranks' evaluation raised


class EvaluationFailed(RaylaneError, RuntimeError):
    """Another rank's evaluation raised: that rank re-raises its own error, the others this one,
    naming it."""


class _Repeat:
    """A batch run again for FSDP's collectives only, by a rank whose share has run out."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch


class Evaluator:
    """`sums(output, target or batch)` (the pipeline's eval_sums) over each batch; without it, the
    loss (the model's own, loss_fn's, or step's, with step's metrics) times the batch's count, so
    that dividing by the total count gives the exact average. The count is the batch's samples,
    or `count(batch)`'s units (the pipeline's eval_count: tokens, say)."""

    def __init__(
        self,
        data: Iterable[Any],
        sums: Callable[..., dict[str, torch.Tensor]] | None,
        device: torch.device,
        world_size: int,
        *,
        loss_fn: Callable | None = None,
        step: Callable | None = None,
        count: Callable[[Any], Any] | None = None,
    ) -> None:
        self.data, self.sums, self.device, self.world_size = data, sums, device, world_size
        self.loss_fn, self.step, self.count = loss_fn, step, count
        self._names: list[str] | None = None

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        """Collective. Leaves `model` in eval mode: the loop sets train mode at each epoch."""
        model.eval()
        # DDP's forward broadcasts buffers (BatchNorm's statistics): a collective per batch, which
        # hangs when ranks hold different numbers of held-out batches (a stream's file shares).
        # Evaluation needs no gradient sync, so it runs the wrapped module itself.
        module = model.module if isinstance(model, DistributedDataParallel) else model
        sums: dict[str, Any] = {}
        count, failure = 0, None
        for batch in self._batches(module):
            try:
                if isinstance(batch, _Repeat):  # FSDP's collectives only: nothing is counted
                    self._batch_sums(module, batch.batch, 0)
                    continue
                n = self.count(batch) if self.count is not None else batch_size(batch)
                if isinstance(module, PipelineModel) and not module.pipeline.has_last:
                    n = 0  # a pipeline's last stage alone counts its batches
                for name, value in self._batch_sums(module, batch, n).items():
                    sums[name] = sums.get(name, 0) + value
                count = count + n
            except Exception as exc:  # noqa: BLE001 - the others would wait in the reduction below: it tells them
                self._share_failure = exc
                if not self._sharded:  # under FSDP, the next batch's vote stops every rank
                    break
        failure = self._share_failure
        for name in self._agreed_names(sums):  # a rank whose share was empty sums zeros
            sums.setdefault(name, torch.zeros((), device=self.device))
        sums = {k: v if isinstance(v, torch.Tensor) else torch.tensor(float(v)) for k, v in sums.items()}
        sums["count"] = count if isinstance(count, torch.Tensor) else torch.tensor(float(count))
        sums[FAILED] = torch.tensor(float(failure is not None))
        totals = all_reduce_sums(sums)
        if totals.pop(FAILED):
            elsewhere = self._failed_rank(failure) if self.world_size > 1 else None  # collective
            raise failure or EvaluationFailed(f"the evaluation failed on {elsewhere}")
        n = totals.pop("count")
        return {k: v / max(n, 1.0) for k, v in totals.items()}

    def _batches(self, module: torch.nn.Module) -> Iterator[Any]:
        """This rank's held-out batches, on the device. A sharded model (FSDP2) gathers its
        parameters from every rank in each forward, so ranks must run as many forwards: shares
        differ (a stream's files, an uneven split), and a rank whose share has run out repeats
        its last batch, uncounted, until every rank's has; a rank whose share is empty runs the
        first batch of the lowest rank that has one, uncounted. One vote a batch, under FSDP only."""
        self._share_failure: Exception | None = None
        self._sharded = sharded = self.world_size > 1 and hasattr(module, "set_requires_gradient_sync")
        batches, last = iter(self.data), None
        while True:
            try:
                batch = next(batches, None) if self._share_failure is None else None
            except Exception as exc:  # noqa: BLE001 - reading the data failed: every rank must learn of it
                batch, self._share_failure = None, exc
            if sharded:
                vote = all_reduce_max(self._vote(batch, last), self.device)
                if not vote["more"] or vote["failed"]:
                    return
                if vote["empty"]:  # in the same round on every rank: a collective
                    lent = self._lend(batch, last, self.world_size - int(vote["lender"]))
                    last = last if last is not None else lent
                if batch is None:
                    yield _Repeat(last)
                    continue
            elif batch is None:
                return
            last = to_device(batch, self.device)
            yield last

    def _vote(self, batch: Any, last: Any) -> dict[str, float]:
        """What the ranks agree on before each forward under FSDP (a MAX over ranks): whether any
        rank has a batch left, whether any failed, whether any has had none at all, and the
        lowest rank with a batch now (as world_size - rank)."""
        import torch.distributed as dist

        return {
            "more": float(batch is not None),
            "failed": float(self._share_failure is not None),
            "empty": float(batch is None and last is None),
            "lender": float(self.world_size - dist.get_rank()) if batch is not None else 0.0,
        }

    def _lend(self, batch: Any, last: Any, lender: int) -> Any:
        """Collective: rank `lender`'s batch, for the ranks with no held-out batch at all to run
        FSDP's forward on, uncounted (the sums stay those of the ranks with data)."""
        import torch.distributed as dist

        sent = [to_device(batch, torch.device("cpu")) if dist.get_rank() == lender else None]
        dist.broadcast_object_list(sent, src=lender)
        return to_device(sent[0], self.device) if last is None and batch is None else None

    def _batch_sums(self, module: torch.nn.Module, batch: Any, n: Any) -> dict[str, Any]:
        if isinstance(module, PipelineModel):
            return self._pipeline_sums(module, batch, n)
        if self.sums is not None:
            form = form_of(batch, None)
            return self.sums(call_model(module, batch, form), batch[1] if form == "pair" else batch)
        loss, output, metrics = forward_loss(module, batch, self.loss_fn, self.step)
        if loss is None:
            checked_own_loss(output, module)  # the output has no loss: say so
        return {
            "loss": loss.detach().float() * n,
            **{k: (v.detach().float() if isinstance(v, torch.Tensor) else float(v)) * n for k, v in metrics.items()},
        }

    def _pipeline_sums(self, module: PipelineModel, batch: Any, n: Any) -> dict[str, Any]:
        """An (input, target) batch through the pipeline's stages, forward only: its sums on the
        last stage, none elsewhere (the sum over ranks adds the last stages')."""
        pipeline = module.pipeline
        source, target = pipeline.pair(batch)
        output = pipeline.forward_only(source)
        if output is None:
            return {}
        if self.sums is not None:
            return self.sums(output, target)
        return {"loss": pipeline.loss_fn(output, target).detach().float() * n}

    def _failed_rank(self, failure: Exception | None = None) -> str:
        """Collective, once evaluation failed somewhere: 'rank N: Type: message' of the first
        rank it failed on, for the ranks where it did not (a torchrun driver is rank 0)."""
        import torch.distributed as dist

        mine = f"{type(failure).__name__}: {failure}" if failure is not None else None
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        return next(f"rank {rank}: {text}" for rank, text in enumerate(gathered) if text)

    def _agreed_names(self, sums: dict[str, torch.Tensor]) -> list[str]:
        """The metric names, agreed by every rank once (all_reduce_sums needs the same keys
        everywhere, and a stream's held-out share may be empty on some rank)."""
        if self._names is None:
            names = [sorted(sums)]
            if self.world_size > 1:
                import torch.distributed as dist

                gathered: list[Any] = [None] * self.world_size
                dist.all_gather_object(gathered, names[0])
                names = gathered
            self._names = sorted(set().union(*names))
        return self._names


class EvalSets:
    """The held-out sets by name, one Evaluator each (`make(data)`), evaluated in turn: a named
    set's metrics as `<name>/<metric>` (`val/loss`), the one unnamed set's (name None) as they
    are (`loss`). Every name is the same on every rank, so the collectives line up."""

    def __init__(self, data: Any, make: Callable[[Iterable], Evaluator]) -> None:
        sets = data if isinstance(data, dict) else {None: data}
        self.evaluators = {name: make(loader) for name, loader in sets.items()}

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        """Collective. Leaves `model` in eval mode, as Evaluator does."""
        metrics: dict[str, float] = {}
        for name, evaluator in self.evaluators.items():
            metrics.update({k if name is None else f"{name}/{k}": v for k, v in evaluator(model).items()})
        return metrics


class Evaluation:
    """The Trainer's evaluations and their schedule (train.eval_every_n_epochs at epoch ends,
    train.eval_every_n_steps, the run's last after its last step), composed of the held-out sets'
    `evaluator` (None: no held-out set, empty metrics), the `reporter` that logs their metrics,
    early stopping (train.early_stopping), which counts them, the `hooks` called after each, and
    `keep(epoch_end)`, the Trainer's save of the step an evaluation failed at. The metrics are
    all-reduced, so that every rank takes the same decision at the same step. `metrics` are the
    last measured, at `step`."""

    def __init__(
        self,
        evaluator: EvalSets | None,
        model: torch.nn.Module,
        reporter: Reporter,
        train: TrainSection,
        hooks: Hooks,
        keep: Callable[[bool], None],
    ) -> None:
        self.evaluator, self.model, self.reporter = evaluator, model, reporter
        self.early_stop, self.hooks, self.keep = EarlyStopping(train.early_stopping), hooks, keep
        self.every_n_steps, self.every_n_epochs = train.eval_every_n_steps, train.eval_every_n_epochs
        self.metrics: dict[str, float] = {}
        self.step: int | None = None

    @property
    def stopped(self) -> bool:
        """Early stopping has ended the run (or had, before a resume)."""
        return self.early_stop.stopped

    def due(self, step: int, epoch: int, *, epoch_end: bool) -> bool:
        """An evaluation is due at `step` of `epoch` (counted from 0; `epoch_end`: its last step):
        one of every train.eval_every_n_steps, and at an epoch's end one of every
        train.eval_every_n_epochs too."""
        return _every(step, self.every_n_steps) or (epoch_end and _every(epoch + 1, self.every_n_epochs))

    def at_step(self, step: int, epoch: int, *, epoch_end: bool) -> None:
        """Collective. The evaluation due at `step` of `epoch` (none when none is), measured before
        the checkpoint of its step, which carries the metrics checkpoint.keep_best ranks by.
        Should the measurement fail (the user's eval_sums, a bad held-out row: on any rank, all
        learn of it), the step is saved (`keep`) before the error ends the run, so that no step
        trained since the last checkpoint is lost."""
        if not self.due(step, epoch, epoch_end=epoch_end):
            return
        try:
            metrics = self.measure()
        except Exception:
            try:
                self.keep(epoch_end)  # without metrics: none were measured
            except Exception as exc:  # noqa: BLE001 - the evaluation's error is the run's
                log.warning("the checkpoint at step %d, after the evaluation failed, was not saved: %s", step, exc)
            raise
        self.record(metrics, step, epoch, epoch_end=epoch_end)

    def last(self, step: int, epoch: int, batch_in_epoch: int) -> None:
        """Collective. The run's last evaluation, at its last `step` (a max_steps stop mid-epoch, an
        epoch left unevaluated, a run resumed at its end), unless that step is measured already;
        `epoch` and `batch_in_epoch`: the loop's position, moved past an epoch that ended."""
        if self.step == step:
            return
        # Named as the display shows it: an ended epoch's (the loop has moved past it), else its step.
        ended = batch_in_epoch == 0 and epoch > 0
        self.run(step, epoch - ended, epoch_end=ended, final=True)

    def run(self, step: int, epoch: int, *, epoch_end: bool = True, final: bool = False) -> dict[str, float]:
        """Collective. Evaluate the model at `step` of `epoch`, report the metrics (`epoch_end`:
        False part-way through an epoch), let early stopping count them (not the run's `final`
        evaluation, after its last step: there is nothing left to stop) and call the hooks' on_eval_end."""
        return self.record(self.measure(), step, epoch, epoch_end=epoch_end, final=final)

    def record(
        self, metrics: dict[str, float], step: int, epoch: int, *, epoch_end: bool = True, final: bool = False
    ) -> dict[str, float]:
        """What follows a measurement of `metrics` at `step` (`run`'s second half)."""
        self.metrics, self.step = metrics, step
        self.reporter.on_eval(epoch=epoch, step=step, metrics=metrics, epoch_end=epoch_end)
        if not final:
            self.early_stop.update(metrics, step)
        self.hooks.call("on_eval_end", metrics=metrics)
        return metrics

    def state_dict(self, step: int) -> dict[str, Any]:
        """What a checkpoint at `step` holds of it: the metrics measured at that very step (an
        epoch end's), which checkpoint.keep_best ranks by, and early stopping's count."""
        return {
            "eval_metrics": self.metrics if self.step == step else None,
            "early_stopping": self.early_stop.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """From a checkpoint's train `state`, at its `step`."""
        if state.get("eval_metrics"):
            self.metrics, self.step = dict(state["eval_metrics"]), step
        self.early_stop.load_state_dict(state.get("early_stopping"))

    def measure(self) -> dict[str, float]:
        """Collective. The model as it is, on the held-out sets ({} without one); back in train
        mode after (a hook's ctx.evaluate())."""
        if self.evaluator is None:
            return {}
        try:
            return self.evaluator(self.model)
        finally:
            self.model.train()
            if callable(reshard := getattr(self.model, "reshard", None)):  # FSDP's root keeps its gathered
                reshard()  # parameters after a forward: sharded again, as hooks and saves expect


def _every(count: int, n: int) -> bool:
    """Whether the `count`-th occurrence is one of every `n` (never when n is 0)."""
    return n > 0 and count % n == 0


def set_names_problem(eval_set: Any) -> str | None:
    """What is wrong with a Pipeline's `eval_set` given as {name: dataset}, or None."""
    if not isinstance(eval_set, dict):
        return None
    if not eval_set:
        return "an empty dict as eval_set: give None for no held-out set, or {name: dataset}"
    for name, data in eval_set.items():
        if not isinstance(name, str) or not SET_NAME.fullmatch(name):
            return (
                f"an eval_set named {name!r}: a held-out set's name is letters, digits, '_' or '-' "
                "(its metrics are logged as <name>/<metric>)"
            )
        if data is None:
            return f"an eval_set whose set {name!r} is None"
    return None
