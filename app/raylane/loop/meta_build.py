"""A pipeline built for the checks before launch (`raylane check --plan`, and `raylane train`'s
plan and stage checks): its `build(cfg)` run in this process with the model on the meta device
(shapes, no memory, nothing initialized) and everything else as on a rank.

Why only the model: a `build()` makes its data too, and data code reads values (`int(label)`,
`tensor.item()`, numpy, a vocabulary counted from the tokens) that a meta tensor does not have:
built wholly on the meta device, `examples/own-model` failed with `Tensor.item() cannot be
called on meta tensors`. So the tensors made while a `torch.nn.Module` is being constructed
(any frame of its `__init__` on the stack: its parameters, buffers, their initialization) go to
the meta device, and every other tensor is made where the code asks, as on a rank. The data
code's cost is paid once here; the model's is not (a 70B model costs nothing).

A model whose own constructor needs values (`torch.linspace(0, p, n).tolist()`, timm's drop-path
rates) fails on the meta device: it is built again on the CPU, the tensors its constructors make
counted, and given up past CPU_CAP_BYTES (the check then says it could not look, and why)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from raylane.loop.distributed.devices import size_text

# The most a model's constructors may make on the CPU when the meta device cannot build it.
CPU_CAP_BYTES = 1 << 30


class Unchecked(Exception):
    """The model could not be built for the checks (not the user's mistake as such): why, one line."""


def _in_module_init() -> bool:
    """Whether a frame of some torch.nn.Module's `__init__` is on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_varnames[:1] == ("self",):
            if isinstance(frame.f_locals.get("self"), nn.Module):
                return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _name(func: Any) -> str | None:
    return getattr(func, "__name__", None)


# The factory functions by name, listed when this module is imported, not torch's cached list:
# torch caches its list on first use, and transformers' loading puts its own `_safe_linspace` in
# place of torch.linspace for a while; a list first made then keeps the wrapper for good, and the
# real function went by unredirected (seen: a model whose constructor reads values built on meta
# after an HF model's load in the same process). The real function keeps its name, wrapped or not.
_CONSTRUCTORS = frozenset(
    filter(None, map(_name, getattr(_device_constructors, "__wrapped__", _device_constructors)()))
)


class _ModulesOn(TorchFunctionMode):
    """Factory calls without a device made inside a module's constructor go to `device`; on the
    CPU (`cap` set), their bytes are counted and Unchecked raised past `cap`."""

    def __init__(self, device: str, cap: int | None = None) -> None:
        super().__init__()
        self.device, self.cap, self.made = torch.device(device), cap, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _name(func) not in _CONSTRUCTORS or kwargs.get("device") is not None or not _in_module_init():
            return func(*args, **kwargs)
        if self.cap is None:
            kwargs["device"] = self.device
        out = func(*args, **kwargs)
        if self.cap is not None and isinstance(out, torch.Tensor):
            self.made += out.numel() * out.element_size()
            if self.made > self.cap:
                raise Unchecked(f"its constructors make over {size_text(self.cap)} on the CPU")
        return out


@contextmanager
def modules_on_meta() -> Iterator[None]:
    """Inside: modules constructed on the meta device, every other tensor where it is asked for."""
    with _ModulesOn("meta"):
        yield


def build_for_checks(cfg: Any) -> Any:
    """The config's Pipeline, its model on the meta device (or on the CPU, within CPU_CAP_BYTES,
    when its constructors need values: see the module's docstring). The user's build() raising
    is its PipelineBuildError, as on a rank; Unchecked when the model cannot be built here."""
    from raylane.loop.usercode import build_pipeline

    try:
        with modules_on_meta():
            return build_pipeline(cfg)
    except Exception as exc:  # noqa: BLE001 - told apart below
        if not _of_meta(exc):
            raise
        first = exc
    mode = _ModulesOn("cpu", cap=CPU_CAP_BYTES)
    try:
        with mode:
            return build_pipeline(cfg)
    except Exception as exc:  # noqa: BLE001 - the cap, in build()'s own error
        if _cause(exc, Unchecked) is not None:
            raise Unchecked(f"{first}; and {_cause(exc, Unchecked)}") from None
        raise


def _of_meta(exc: BaseException) -> bool:
    """Whether an error came of a meta tensor: torch's message names the device (build()'s own
    error, a UserCodeError, only quotes it)."""
    from raylane.pipelines_ref import UserCodeError

    seen: BaseException | None = exc
    while seen is not None:
        if not isinstance(seen, UserCodeError) and "meta" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _cause(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None
