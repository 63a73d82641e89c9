"""Agreement between ranks on a save's outcome: every rank raises the same CheckpointSaveError, or
none does. A failure on one rank (a full disk, a refused upload) is passed to all in the commit's
collectives, so that no rank goes on believing in a checkpoint another could not write.

A save committed on a background thread runs these collectives on a process group of its own
(`collectives_on`), never on the one the training loop's all-reduces use."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from raylane.errors import RaylaneError


class CheckpointSaveError(RaylaneError, RuntimeError):
    """A checkpoint could not be written; raised on every rank alike. Nothing was committed, so
    the previous checkpoint is still the latest valid one."""


def save_errors() -> tuple[type[BaseException], ...]:
    """What a save catches and reports to every rank rather than raising at once."""
    # DCP's CheckpointException derives from BaseException, not Exception.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def describe(exc: BaseException, rank: int) -> str:
    """'rank N: Type: message', naming the rank where it started: DCP re-raises one rank's
    failure on every rank as a CheckpointException that maps ranks to their errors."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, exc = next(iter(sorted(failures.items())))
        exc = exc[0] if isinstance(exc, tuple) else exc
    return f"rank {rank}: {type(exc).__name__}: {exc}"


_collectives = threading.local()


@contextlib.contextmanager
def collectives_on(group: Any) -> Iterator[None]:
    """Run this thread's checkpoint collectives on `group`: a save committed on a background
    thread must never share a process group with the training loop's collectives."""
    previous = getattr(_collectives, "group", None)
    _collectives.group = group
    try:
        yield
    finally:
        _collectives.group = previous


def current_group() -> Any:
    """The process group this thread's checkpoint collectives use (None: the default one)."""
    return getattr(_collectives, "group", None)


# A commit's gather (each rank's generators, files and error, as JSON) fits in this many bytes
# per rank unless a rank wrote many files: one all_gather of fixed-size buffers then, where
# all_gather_object takes two and a pickle each way (~0.3 ms of each rank's CPU per save on
# 2 busy cores, bench B9). A larger payload takes the second, general round.
GATHER_BUFFER_BYTES = 1 << 15


def gather(obj: Any) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order, on every rank."""
    group = current_group()
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    data = json.dumps(obj).encode()
    fits = len(data) <= GATHER_BUFFER_BYTES
    mine = torch.zeros(GATHER_BUFFER_BYTES + 8, dtype=torch.uint8)
    mine[:8] = torch.tensor([len(data) if fits else -1], dtype=torch.int64).view(torch.uint8)
    if fits:
        mine[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    lengths = [int(part[:8].view(torch.int64)) for part in parts]
    if min(lengths) < 0:  # some rank's did not fit: every rank takes the general round
        gathered: list[Any] = [None] * len(parts)
        dist.all_gather_object(gathered, obj, group=group)
        return gathered
    return [json.loads(part[8 : 8 + n].numpy().tobytes()) for part, n in zip(parts, lengths, strict=True)]


def vote(step: int, part: dict[str, Any]) -> list[dict[str, Any]]:
    """Collective: every rank's `part` (its "error", None or a description, and what else the
    commit needs of it), in rank order. If any rank's error is set, every rank raises the same
    CheckpointSaveError."""
    gathered = gather(part)
    _fail_if(step, [p["error"] for p in gathered])
    return gathered


def raise_if_any(step: int, error: str | None, *, only_rank_zero: bool = False) -> None:
    """Collective: each rank passes its error or None; if any (or rank 0's, with
    `only_rank_zero`) is set, every rank raises the same CheckpointSaveError."""
    if only_rank_zero:
        _fail_if(step, [_from_rank_zero(error)])
    else:
        _fail_if(step, gather(error))


def _from_rank_zero(message: str | None) -> str | None:
    """Rank 0's `message`, on every rank: one small broadcast when it is None (the usual case)
    rather than an object broadcast's two and its pickles."""
    group = current_group()
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return message
    flag = torch.tensor([message is not None], dtype=torch.uint8)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(flag, src=src, group=group)
    if not flag.item():
        return None
    box = [message]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _fail_if(step: int, errors: list[str | None]) -> None:
    if failed := [e for e in errors if e]:
        raise CheckpointSaveError(f"checkpoint at step {step} was not saved ({grouped(failed)})")


def grouped(failures: list[str]) -> str:
    """Ranks' failures ('rank N: Type: message', `describe`) as one line, the ranks that failed
    alike named together: a file system every rank writes to failing (read-only, full) is one
    entry, `ranks 0-255: OSError: ...`, not one copy per rank."""
    ranks: dict[str, list[int]] = {}
    for failure in failures:
        head, sep, text = failure.partition(": ")
        number = head.removeprefix("rank ")
        if sep and head.startswith("rank ") and number.isdigit():
            ranks.setdefault(text, []).append(int(number))
        else:
            ranks.setdefault(failure, [])
    return "; ".join(f"{_ranks(found)}: {text}" if found else text for text, found in ranks.items())


def _ranks(numbers: list[int]) -> str:
    """'rank 3', 'ranks 0, 2', 'ranks 0-255, 300': runs of three or more as a range."""
    numbers = sorted(set(numbers))
    if len(numbers) == 1:
        return f"rank {numbers[0]}"
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    parts = [f"{r[0]}-{r[-1]}" if len(r) >= 3 else ", ".join(map(str, r)) for r in runs]
    return "ranks " + ", ".join(parts)
