"""An error in the user's pipeline code, said in one line: which of the pipeline's functions
raised or returned what its contract does not allow (build(cfg), loss_fn, eval_sums, the model's
forward, a dataset's __getitem__ or __len__, a FileSource's transform or to_tensors), the
exception, and the innermost `file:line` of the user's own code.

Nothing here costs a training step: an exception is explained from its traceback once it has
left the rank's run (`explain`), and the return values the loop relies on are checked at the
first call only (`check_first_calls`), after which the loop calls the user's functions directly.
The full traceback goes to the library log (the driver's, see raylane.logs.record_traceback)."""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Callable
from types import CodeType
from typing import Any

from raylane import pipelines_ref
from raylane.loop.baddata import DataError
from raylane.pipelines_ref import UserCodeError

TRACEBACK_ATTR = "raylane_traceback"
LOSS_ROLE = "loss_fn(output, target)"
SUMS_ROLE = "eval_sums(output, target)"
_UNUSED = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
_DDP_KEYWORD = "`find_unused_parameters=True`"  # in torch's message, which names no raylane key


def pipeline_problem(pipe: Any) -> str | None:
    """What is wrong with `build(cfg)`'s return value, or None: the loop's contract."""
    import torch

    from raylane.loop.pipeline import Pipeline

    if not isinstance(pipe, Pipeline):
        return f"{type(pipe).__name__}, not raylane.Pipeline"
    if not isinstance(pipe.model, torch.nn.Module):
        return f"a Pipeline whose model is {type(pipe.model).__name__}, not a torch.nn.Module"
    if pipe.train_set is None:
        return "a Pipeline without a train_set"
    for name in ("loss_fn", "eval_sums", "step", "eval_count"):  # each optional
        value = getattr(pipe, name)
        if value is not None and not callable(value):
            return f"a Pipeline whose {name} is {type(value).__name__}, not a function"
    return None


def check_first_calls(trainer: Any, pipe: Any, cfg: Any) -> None:
    """Check what loss_fn and eval_sums return, at their first call; later calls go straight to
    the user's functions (the wrappers put them back). The batch's form, the model's own loss and
    a step's return are checked by the trainer's Forward at the first batch (raylane.loop.batches)."""
    from raylane.loop.batches import loss_problem

    if pipe.loss_fn is not None:
        _once(trainer.forward, "loss_fn", pipe.loss_fn, loss_problem, LOSS_ROLE, cfg)
    if trainer.evaluator is not None and pipe.eval_sums is not None:
        _once(trainer.evaluator, "sums", pipe.eval_sums, _sums_problem, SUMS_ROLE, cfg)


def _once(owner: Any, attr: str, fn: Callable, problem: Callable[[Any], str | None], role: str, cfg: Any) -> None:
    def first(*args: Any) -> Any:
        setattr(owner, attr, fn)
        out = fn(*args)
        if (text := problem(out)) is not None:
            raise UserCodeError(f"pipeline {cfg.pipeline!r}: {role} returned {text} "
                                f"(at {pipelines_ref.returned_at(_function(fn))})")
        return out

    setattr(owner, attr, first)


def _sums_problem(sums: Any) -> str | None:
    import torch

    if not isinstance(sums, dict):
        return f"{type(sums).__name__}: it must return a dict of metric name -> tensor (sums over the batch)"
    wrong = {k: type(v).__name__ for k, v in sums.items() if not isinstance(v, torch.Tensor)}
    if wrong:
        shown = "{" + ", ".join(f"{k!r}: {t}" for k, t in wrong.items()) + "}"
        return f"{shown}: it must return tensors (sums over the batch)"
    return None


def explain(exc: BaseException, cfg: Any, pipe: Any) -> BaseException:
    """The exception a rank's run ends with, for `exc` that left it: one line naming the user's
    function and place when the user's code raised, else `exc` itself."""
    from raylane.loop.batches import BatchFormError  # torch: loaded by now, on a rank

    if isinstance(exc, (UserCodeError, DataError)):
        return exc
    if isinstance(exc, BatchFormError):  # a batch, output or step return of the wrong form (one line)
        return UserCodeError(f"pipeline {cfg.pipeline!r}: {exc}")
    if pipe is not None and _DDP_KEYWORD in str(exc):
        return _unused_parameters(exc, pipe)
    if _not_the_users(exc):
        return exc
    module = pipelines_ref.load(cfg.pipeline)
    roles = _roles(pipe, module)
    own = [getattr(module, "__file__", None) or ""]
    at = pipelines_ref.user_frame(exc, own)
    role = _role(exc, roles, own)
    if at is None or role is None:
        return exc
    text = " ".join(str(exc).split())
    notes = "".join(f"; {note}" for note in getattr(exc, "__notes__", ()))  # the data's place (baddata)
    return UserCodeError(f"pipeline {cfg.pipeline!r}: {role} raised {type(exc).__name__}: {text} (at {at}{notes})")


def _not_the_users(exc: BaseException) -> bool:
    """Errors that surface inside the user's forward but are the machine's or the group's: out of
    memory, and a collective that failed or timed out in a hook (FSDP's all-gathers)."""
    import torch

    distributed = getattr(torch.distributed, "DistError", ())
    return isinstance(exc, (torch.OutOfMemoryError, *((distributed,) if distributed else ())))


def keep_traceback(error: BaseException, exc: BaseException) -> None:
    """Keep `exc`'s whole traceback, as text, on the `error` a rank fails with: pickled with it
    (an exception's attributes travel with it), it reaches a Ray driver's library log, where
    Ray's own message has only a cut snippet of it."""
    with contextlib.suppress(AttributeError):  # an exception class with __slots__
        setattr(error, TRACEBACK_ATTR, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def _role(exc: BaseException, roles: dict[CodeType, str], own: list[str]) -> str | None:
    """The contract function the exception left: the outermost frame that is one of them, else
    the outermost frame of the user's code, by its name."""
    frames = [frame.f_code for frame, _ in traceback.walk_tb(exc.__traceback__)]
    named = next((roles[code] for code in frames if code in roles), None)
    if named:
        return named
    mine = next((code for code in frames if pipelines_ref.is_user_file(code.co_filename, own)), None)
    return f"{mine.co_name}()" if mine else None


def _roles(pipe: Any, module: Any) -> dict[CodeType, str]:
    """The code of each function of the pipeline's contract -> how a message names it."""
    from raylane.loop.batches import STEP_ROLE

    named: list[tuple[str, Any]] = [("build(cfg)", getattr(module, "build", None)),
                                    ("sources(cfg)", getattr(module, "sources", None))]
    if pipe is not None:
        named += [(LOSS_ROLE, pipe.loss_fn), (SUMS_ROLE, pipe.eval_sums), (STEP_ROLE, pipe.step),
                  ("eval_count(batch)", pipe.eval_count),
                  ("the model's forward", getattr(type(pipe.model), "forward", None))]
        for name in ("train_set", "eval_set"):
            data = getattr(pipe, name)
            if data is None:
                continue
            if hasattr(data, "to_tensors"):  # a FileSource
                named += [(f"{name}'s FileSource.to_tensors", data.to_tensors),
                          (f"{name}'s FileSource.transform", data.transform)]
            else:
                named += [(f"{name}.{method}", getattr(type(data), method, None))
                          for method in ("__getitem__", "__len__", "__iter__")]
    roles: dict[CodeType, str] = {}
    for role, fn in named:
        code = getattr(_function(fn), "__code__", None)
        if code is not None:
            roles.setdefault(code, role)
    return roles


def _function(fn: Any) -> Any:
    """The Python function behind a callable: a bound method's, a partial's, or a callable
    object's forward (a torch module) or __call__."""
    fn = getattr(fn, "func", fn)  # functools.partial
    fn = getattr(fn, "__func__", fn)
    if fn is None or hasattr(fn, "__code__") or isinstance(fn, type):
        return fn
    method = getattr(type(fn), "forward", None) or type(fn).__call__
    return getattr(method, "__func__", method)


def _unused_parameters(exc: BaseException, pipe: Any) -> UserCodeError:
    """DDP's error for parameters that got no gradient, with raylane's key and the parameters'
    names (torch's message gives their indices and its own keyword)."""
    found = _UNUSED.search(str(exc))
    which, where = "some parameters", ""
    if found:
        names = [name for name, p in pipe.model.named_parameters() if p.requires_grad]
        listed = [names[int(i)] if int(i) < len(names) else f"#{i}" for i in found.group(2).split()]
        which = ", ".join(listed[:6]) + (f" and {len(listed) - 6} more" if len(listed) > 6 else "")
        where = f" on rank {found.group(1)}"
    return UserCodeError(f"strategy.find_unused_parameters = false: the model's {which} got no gradient at a step"
                         f"{where} (not used to compute the loss): set strategy.find_unused_parameters: true, or "
                         "use every parameter in forward")
