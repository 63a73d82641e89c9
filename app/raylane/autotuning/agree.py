"""How the ranks of a `raylane autotune` search agree: rank 0's plan sent to every rank, and one
small all-reduce after each step that could fail on one rank alone, so that a candidate that
does not fit on one rank is infeasible on all of them (raylane.autotuning.search says why).
Ray-free, like the rest of the search."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from raylane.loop.protocols.runtime import Runtime


class Agreement:
    """The ranks' agreements, on gloo, off the training group (a CUDA stream never delays them);
    in one process each is the rank's own answer."""

    def __init__(self, runtime: Runtime, use_gpu: bool) -> None:
        self.rank, self.world_size = runtime.rank, runtime.world_size
        self.distributed = dist.is_initialized() and self.world_size > 1
        self.group = dist.new_group(backend="gloo") if self.distributed and use_gpu else None

    def broadcast(self, message: Any) -> Any:
        """Rank 0's `message`, on every rank."""
        if not self.distributed:
            return message
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def failures(
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
            box: list[Any] = [error]
            dist.broadcast_object_list(box, src=error_rank, group=self.group)
            failure = (error_rank, str(box[0]))
        return (oom_rank if oom_rank >= 0 else None), failure, bool(flags[2].item() > 0), int(flags[3].item())

    def max(self, value: int) -> int:
        """The largest `value` of any rank."""
        if not self.distributed:
            return int(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())
