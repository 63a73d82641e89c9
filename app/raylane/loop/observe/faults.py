"""Fault injection for tests and drills, planned through the environment of the workers:

    RAYLANE_FAULTS="raise@rank=1,step=5;nan@step=7;hang@rank=0,step=3;diskfull@rank=1,step=40;oom@rank=1,batch=32"
    RAYLANE_FAULTS="slow@rank=1,ms=60"  or  "slowdata@rank=1,ms=60,step=10"

`raise` raises RuntimeError on that rank at that step, `nan` turns that step's loss into NaN
(on the given rank, or all), `hang` blocks that rank forever (a rank stuck outside a
collective), `diskfull` makes that rank's checkpoint files at that step land on /dev/full, so
its writes fail with the kernel's own ENOSPC, `oom` raises torch.OutOfMemoryError in that
rank's forward of a micro-batch of at least `batch` samples (autotune's probe: a CPU cannot run
out of device memory on cue). `slow` and `slowdata` make a straggler of that rank from `step` on
(default: every step): `slow` sleeps `ms` inside its step, after its batch is in hand (its own
compute is slow), `slowdata` sleeps `ms` while it waits for its batch (a slow loader), so the
step timer (raylane.loop.observe.steptimes) tells the one from the other. A plan costs nothing when the
variable is unset: `load()` returns None."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

from raylane.errors import RaylaneError
from raylane.loop.observe.observer import Observer

ENV = "RAYLANE_FAULTS"
KINDS = ("raise", "nan", "hang", "diskfull", "oom", "slow", "slowdata")
# Keyed by a duration, not a step: from `step` on (every step when unset).
SLOW = ("slow", "slowdata")
FULL_DEVICE = "/dev/full"


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # -1 for oom, which is keyed by batch size; slow ones: the first step slowed (0: all)
    rank: int | None  # None: every rank
    batch: int | None = None
    ms: float = 0.0  # slow, slowdata: the sleep each step


class InjectedFault(RaylaneError, RuntimeError):
    pass


class FaultPlan(Observer):
    """This rank's faults. An observer of the loop placed after the step timer, so that each
    sleep is timed where a real one would be: `slowdata` at a step's start (its data wait),
    `slow` and the step's `raise` or `hang` with its batch in hand (its compute); the loss is
    corrupted inside the step (`corrupt_loss`), a save's files in the save (`before_save`)."""

    def __init__(self, faults: list[Fault], rank: int) -> None:
        mine = [f for f in faults if f.rank in (None, rank)]
        self.by_step = {f.step: f for f in mine if f.kind not in ("oom", *SLOW)}
        self.oom_from_batch = min((f.batch for f in mine if f.kind == "oom"), default=None)
        self.slow = {kind: next(((f.step, f.ms / 1000) for f in mine if f.kind == kind), None) for kind in SLOW}
        self.rank = rank

    def on_step_start(self, step: int) -> None:
        self.before_fetch(step)

    def on_batch(self, step: int) -> None:
        self.before_step(step)

    def before_fetch(self, step: int) -> None:
        """While this rank waits for the batch of `step` (timed as its data wait)."""
        self._sleep("slowdata", step)

    def _sleep(self, kind: str, step: int) -> None:
        slow = self.slow[kind]
        if slow is not None and step >= slow[0]:
            time.sleep(slow[1])

    def before_forward(self, batch_size: int) -> None:
        if self.oom_from_batch is not None and batch_size >= self.oom_from_batch:
            raise torch.OutOfMemoryError(f"injected: rank {self.rank} out of memory at a micro-batch of {batch_size}")

    def before_step(self, step: int) -> None:
        """With the batch of `step` in hand, before its forward (timed as the step's compute)."""
        self._sleep("slow", step)
        fault = self.by_step.get(step)
        if fault and fault.kind == "raise":
            raise InjectedFault(f"injected failure on rank {self.rank} at step {step}")
        if fault and fault.kind == "hang":
            print(f"raylane: injected fault: rank {self.rank} hangs at step {step}", file=sys.stderr, flush=True)
            while True:
                time.sleep(3600)

    def before_save(self, step: int, path: str) -> None:
        fault = self.by_step.get(step)
        if fault and fault.kind == "diskfull":
            # A replicated state is rank 0's `state.pt` (other ranks write nothing); DCP names a
            # rank's first shard `__<rank>_0.distcp`, and each rank of a sharded state writes its
            # random generators' file. Each is opened for writing following the link, so the
            # first of them this rank writes fails with ENOSPC, as on a full disk.
            names = [f"__{self.rank}_0.distcp", f"rng_{self.rank}.json"] + (["state.pt"] if self.rank == 0 else [])
            for name in names:
                os.symlink(FULL_DEVICE, os.path.join(path, name))

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        fault = self.by_step.get(step)
        return loss * float("nan") if fault and fault.kind == "nan" else loss


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, _, params = item.partition("@")
        fields = dict(p.split("=", 1) for p in params.split(",") if "=" in p)
        key = {"oom": "batch", "slow": "ms", "slowdata": "ms"}.get(kind, "step")
        if kind not in KINDS or key not in fields:
            raise ValueError(
                f"{ENV}: cannot parse {item!r} (expected e.g. raise@rank=1,step=5, oom@rank=1,batch=32 or slow@rank=1,ms=60)"
            )
        faults.append(
            Fault(
                kind,
                int(fields.get("step", 0 if kind in SLOW else -1)),
                int(fields["rank"]) if "rank" in fields else None,
                int(fields["batch"]) if "batch" in fields else None,
                float(fields.get("ms", 0.0)),
            )
        )
    return faults


def load(rank: int) -> FaultPlan | None:
    text = os.environ.get(ENV, "")
    return FaultPlan(parse(text), rank) if text else None
