"""A `raylane autotune` candidate's memory on this rank: out-of-memory errors told from others,
its peak, and what its teardown leaves. Ray-free, like the rest of the search."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from raylane.loop.distributed.fsdp import unwrap


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(exc)


def error_text(exc: BaseException) -> str:
    """One line of at most 300 characters: what the agreement sends and the summary shows."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def attempt(step: Callable[[], Any]) -> bool | str:
    """Run `step`: False, or True on out of memory, or another error's message."""
    try:
        step()
        return False
    except Exception as exc:
        return True if is_oom(exc) else error_text(exc)


def memory_now(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return rss()


def rss() -> int:
    """This process's resident set, in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


class PeakSampler:
    """A candidate's peak memory above what was in use before it: the device's peak on GPU; on
    CPU the resident set, sampled at the end of each forward (activations alive) and each step."""

    def __init__(self, device: torch.device, baseline: int, model: torch.nn.Module) -> None:
        self.device, self.baseline, self.peak = device, baseline, 0
        self._hook = None if device.type == "cuda" else unwrap(model).register_forward_hook(lambda *_: self.sample())

    def sample(self) -> None:
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) - self.baseline)
        else:
            self.peak = max(self.peak, rss() - self.baseline)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()


def release(device: torch.device, baseline: int) -> int | None:
    """Free what the candidate held; on GPU, the bytes still allocated above `baseline` after
    that (None on CPU, whose allocator keeps freed pages)."""
    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return max(torch.cuda.memory_allocated(device) - baseline, 0)
