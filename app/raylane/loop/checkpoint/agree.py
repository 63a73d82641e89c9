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

from raylane.errors import RaylaneError, ranks_text


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


def _distributed(group: Any) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def _longest_and_failed(length: int, failed: bool, group: Any) -> tuple[int, bool]:
    """The longest of the ranks' `length`s, and whether any rank `failed`: one all-reduce of two
    numbers, whatever the world size."""
    both = torch.tensor([length, int(failed)], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return int(both[0]), bool(both[1])


def _errors(error: str | None, group: Any) -> list[str | None]:
    """Every rank's error, on every rank: after a failure only (rare), so its pickles cost nothing."""
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return errors


def gather(obj: Any) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order, on the group's rank 0 ([] on the others)."""
    group = current_group()
    if not _distributed(group):
        return [obj]
    data = json.dumps(obj).encode()
    return _gathered(data, _longest_and_failed(len(data), False, group)[0], group)


def _gathered(data: bytes, longest: int, group: Any) -> list[Any]:
    """Every rank's `data` (JSON) on the group's rank 0, in buffers as long as the `longest`. Only
    rank 0 writes the manifest: an all-gather of fixed 32 KB buffers (as this was) put world size
    x 32 KB on every rank at every save, 33.6 MB at 1,024 ranks (bench B15)."""
    mine = torch.zeros(longest + 8, dtype=torch.uint8)
    mine[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    mine[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))] if dist.get_rank() == first else None
    dist.gather(mine, gather_list=parts, dst=first, group=group)
    if parts is None:
        return []
    lengths = [int(part[:8].view(torch.int64)) for part in parts]
    return [json.loads(part[8 : 8 + n].numpy().tobytes()) for part, n in zip(parts, lengths, strict=True)]


def vote(step: int, part: dict[str, Any]) -> list[dict[str, Any]]:
    """Collective: every rank's `part` (its "error", None or a description, and what else the
    commit needs of it), in rank order, on the group's rank 0 ([] on the others). If any rank's
    error is set, every rank raises the same CheckpointSaveError. Two collectives: the longest
    part and whether any failed, then the parts."""
    group = current_group()
    if not _distributed(group):
        _fail_if(step, [part["error"]])
        return [part]
    data = json.dumps(part).encode()
    longest, failed = _longest_and_failed(len(data), part["error"] is not None, group)
    if failed:
        _fail_if(step, _errors(part["error"], group))
    return _gathered(data, longest, group)


def raise_if_any(step: int, error: str | None, *, only_rank_zero: bool = False) -> None:
    """Collective: each rank passes its error or None; if any (or rank 0's, with
    `only_rank_zero`) is set, every rank raises the same CheckpointSaveError. Without a failure,
    one all-reduce of two numbers (a gather of every rank's error, as this was, cost each rank
    world size x 32 KB)."""
    if only_rank_zero:
        _fail_if(step, [_from_rank_zero(error)])
        return
    group = current_group()
    if not _distributed(group):
        _fail_if(step, [error])
    elif _longest_and_failed(0, error is not None, group)[1]:
        _fail_if(step, _errors(error, group))


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
    return "; ".join(f"{ranks_text(found)}: {text}" if found else text for text, found in ranks.items())
