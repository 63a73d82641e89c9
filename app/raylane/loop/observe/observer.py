"""The one interface between the Trainer and what watches its loop (raylane.loop.trainer.Trainer
holds its observers; none of them holds the Trainer). Ray-free.

An observer is told the loop's moments, in the order of the Trainer's observers, on every rank:

- `on_train_start(step)`: `train()` starts, `step` steps taken already (0, or a resume's);
- `on_step_start(step)`: before the batch of step `step` is asked for;
- `on_batch(step)`: that batch is in hand, its forward comes next;
- `on_step_end(step)`: step `step` is taken (its optimizer step, or its skip, is done);
- `on_epoch_end(epoch)`: the epoch's end work (its evaluation and checkpoint) is done;
- `on_train_end(error)`: the loop is over, however it ended (`error`: what ended it, None when
  it ran to its end or a stop); once, before the last window's figures are gathered.

Every method does nothing unless the observer overrides it, and the Trainer calls, at each moment,
only the observers that override it (`watching`): a step pays for what is watched, nothing else.
The step timer's marks inside a step (the arrival at the gradient sync, the end of the backward)
are its own, not moments of this interface: only the timer has use for them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

MOMENTS = ("on_train_start", "on_step_start", "on_batch", "on_step_end", "on_epoch_end", "on_train_end")


class Observer:
    """What watches a rank's loop: override the moments it watches (see the module's doc)."""

    def on_train_start(self, step: int) -> None:
        pass

    def on_step_start(self, step: int) -> None:
        pass

    def on_batch(self, step: int) -> None:
        pass

    def on_step_end(self, step: int) -> None:
        pass

    def on_epoch_end(self, epoch: int) -> None:
        pass

    def on_train_end(self, error: BaseException | None) -> None:
        pass


def watching(observers: Iterable[Observer], moment: str) -> list[Callable[[Any], None]]:
    """The bound `moment` methods of the observers that override it, in their order."""
    if moment not in MOMENTS:
        raise ValueError(f"no observer moment {moment!r} (one of {', '.join(MOMENTS)})")
    default = getattr(Observer, moment)
    return [getattr(o, moment) for o in observers if getattr(type(o), moment, default) is not default]


class Deferred(Observer):
    """An observer made only once it is needed, mid-run (profile.ranks' `slowest`: a profiler, once
    the step times name this rank the straggler): `begin(step)` makes it (once) and starts it at
    `step`; from then on it is told the loop's moments, to its end. Until then nothing of it is
    made, nor its module imported (`make` imports it)."""

    def __init__(self, make: Callable[[], Observer]) -> None:
        self._make: Callable[[], Observer] | None = make
        self.made: Observer | None = None

    def begin(self, step: int) -> None:
        if self._make is not None:
            make, self._make = self._make, None
            self.made = make()
            self.made.on_train_start(step)

    def on_step_start(self, step: int) -> None:
        if self.made is not None:
            self.made.on_step_start(step)

    def on_batch(self, step: int) -> None:
        if self.made is not None:
            self.made.on_batch(step)

    def on_step_end(self, step: int) -> None:
        if self.made is not None:
            self.made.on_step_end(step)

    def on_epoch_end(self, epoch: int) -> None:
        if self.made is not None:
            self.made.on_epoch_end(epoch)

    def on_train_end(self, error: BaseException | None) -> None:
        if self.made is not None:
            self.made.on_train_end(error)


@contextlib.contextmanager
def observing(observers: list[Observer], step: int) -> Iterator[None]:
    """Every observer's `on_train_start(step)` before the block, and its `on_train_end` however
    the block ends, with the error that ended it (None when it ended well)."""
    for observer in observers:
        observer.on_train_start(step)
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        for observer in observers:
            observer.on_train_end(error)
