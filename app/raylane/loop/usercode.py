"""An error in the user's pipeline code, said in one line: which of the pipeline's functions
raised or returned what its contract does not allow (build(cfg), loss_fn, eval_sums, collate_fn,
the model's forward, a dataset's __getitem__ or __len__, a FileSource's transform or to_tensors,
optimizer and scheduler, a hook's methods), the exception, and the innermost `file:line` of the
user's own code; in a DataLoader worker too, from the traceback torch passes on as text.

Nothing here costs a training step: an exception is explained from its traceback once it has
left the rank's run (`explain`), and the return values the loop relies on are checked at the
first call only (`check_first_calls`), after which the loop calls the user's functions directly.
The full traceback goes to the library log (the driver's, see raylane.logs.record_traceback)."""

from __future__ import annotations

import contextlib
import inspect
import re
import traceback
from collections.abc import Callable
from types import CodeType
from typing import Any

from raylane import pipelines_ref
from raylane.errors import ConfigError, DataError
from raylane.pipelines_ref import PipelineBuildError, UserCodeError

TRACEBACK_ATTR = "raylane_traceback"
LOSS_ROLE = "loss_fn(output, target)"
SUMS_ROLE = "eval_sums(output, target)"
COLLATE_ROLE = "collate_fn(items)"
# How torch re-raises an exception of a DataLoader worker (torch.utils._utils.ExceptionWrapper):
# the original traceback, as text, in the message of an exception of the same type.
_WORKER = re.compile(
    r"\ACaught \S+ in (?:DataLoader worker process \d+|pin memory thread[^\n]*)\.\n"
    r"Original Traceback \(most recent call last\):\n"
)
_FRAME = re.compile(r'^  File "(.+)", line (\d+), in (\S+)$', re.MULTILINE)
OPTIMIZER_ROLE = "optimizer(model, cfg)"
SCHEDULER_ROLE = "scheduler(optimizer, cfg, total_steps)"
_UNUSED = re.compile(r"Parameter indices which did not receive grad for rank (\d+): ([\d ]+)")
_STAGE = re.compile(r"\s*\[Stage \d+\] failed to run forward:")  # torch.distributed.pipelining's wrapping
_DDP_KEYWORD = "`find_unused_parameters=True`"  # in torch's message, which names no raylane key


def pipeline_problem(pipe: Any) -> str | None:
    """What is wrong with `build(cfg)`'s return value, or None: the loop's contract."""
    import torch

    from raylane.loop.protocols.pipeline import Pipeline

    if not isinstance(pipe, Pipeline):
        return f"{type(pipe).__name__}, not raylane.Pipeline"
    if not isinstance(pipe.model, torch.nn.Module):
        return f"a Pipeline whose model is {type(pipe.model).__name__}, not a torch.nn.Module"
    if pipe.train_set is None:
        return "a Pipeline without a train_set"
    for name in ("loss_fn", "eval_sums", "step", "eval_count", "collate_fn"):  # each optional
        value = getattr(pipe, name)
        if value is not None and not callable(value):
            return f"a Pipeline whose {name} is {type(value).__name__}, not a function"
    if pipe.step is not None and pipe.eval_sums is not None:
        # eval_sums takes the model's output, and with a step there is none the loop makes.
        return (
            "a Pipeline with both step and eval_sums: with a step, the held-out metrics are its loss and "
            "metrics, averaged over the held-out samples; return them from step and drop eval_sums"
        )
    for name in ("optimizer", "scheduler"):
        if getattr(pipe, name) is not None and not callable(getattr(pipe, name)):
            return f"a Pipeline whose {name} is {type(getattr(pipe, name)).__name__}, not a function or None"
    from raylane.loop.evaluation import set_names_problem

    return set_names_problem(pipe.eval_set) or _hooks_problem(pipe.hooks) or _blocks_problem(pipe)


def _blocks_problem(pipe: Any) -> str | None:
    from raylane.loop.distributed.blocks import given_blocks

    if pipe.blocks is None:
        return None
    try:
        given_blocks(pipe.model, pipe.blocks)
    except (TypeError, ValueError) as exc:
        return f"a Pipeline whose {exc}"
    return None


def _hooks_problem(hooks: Any) -> str | None:
    from raylane.loop.protocols.hooks import METHODS

    if isinstance(hooks, (str, bytes, dict)) or not hasattr(hooks, "__iter__"):
        return f"a Pipeline whose hooks is {type(hooks).__name__}, not a list of hooks (raylane.Hook)"
    for hook in hooks:
        if isinstance(hook, type) or not any(callable(getattr(hook, m, None)) for m in METHODS):
            what = (
                f"the class {hook.__name__} (not an instance of it)" if isinstance(hook, type) else type(hook).__name__
            )
            return f"a Pipeline whose hooks hold {what}: a hook is an object with raylane.Hook's methods"
    return None


def check_first_calls(trainer: Any, pipe: Any, cfg: Any) -> None:
    """Check what loss_fn and eval_sums return, at their first call; later calls go straight to
    the user's functions (the wrappers put them back). The batch's form, the model's own loss and
    a step's return are checked by the trainer's Forward at the first batch (raylane.loop.protocols.batches)."""
    from raylane.loop.protocols.batches import loss_problem

    if pipe.loss_fn is not None:
        _once(trainer.forward, "loss_fn", pipe.loss_fn, loss_problem, LOSS_ROLE, cfg)
    sets = trainer.evaluation.evaluator
    for evaluator in sets.evaluators.values() if sets is not None else ():
        if pipe.eval_sums is not None:
            _once(evaluator, "sums", pipe.eval_sums, _sums_problem, SUMS_ROLE, cfg)


def _once(owner: Any, attr: str, fn: Callable, problem: Callable[[Any], str | None], role: str, cfg: Any) -> None:
    def first(*args: Any) -> Any:
        setattr(owner, attr, fn)
        out = fn(*args)
        if (text := problem(out)) is not None:
            raise wrong_return(cfg, role, fn, text)
        return out

    setattr(owner, attr, first)


def wrong_return(cfg: Any, role: str, fn: Callable, text: str) -> UserCodeError:
    """The error for a pipeline function `fn` that returned `text` (what came and what is expected)."""
    return UserCodeError(
        f"pipeline {cfg.pipeline!r}: {role} returned {text} (at {pipelines_ref.returned_at(_function(fn))})"
    )


def optimizer_problem(optimizer: Any) -> str | None:
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"{type(optimizer).__name__}: it must return a torch.optim.Optimizer over the model's parameters"
    return None


def scheduler_problem(scheduler: Any, optimizer: Any) -> str | None:
    """None is allowed (a constant lr). raylane steps the schedule once per optimizer step, with no
    metric, and checkpoints it with its optimizer."""
    from torch.optim import lr_scheduler

    if scheduler is None:
        return None
    if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau) or not isinstance(scheduler, lr_scheduler.LRScheduler):
        return (
            f"{type(scheduler).__name__}: it must return a torch.optim.lr_scheduler.LRScheduler stepped once per "
            "optimizer step with no metric (not ReduceLROnPlateau), or None"
        )
    if scheduler.optimizer is not optimizer:
        return f"a {type(scheduler).__name__} of another optimizer: it must schedule the optimizer it is given"
    return None


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
    from raylane.loop.protocols.batches import BatchFormError  # torch: loaded by now, on a rank

    if isinstance(exc, (UserCodeError, DataError, ConfigError)):  # one line each already
        return exc
    if (cause := _stage_cause(exc)) is not None:  # a pipeline stage's forward: its own error says where
        explained = explain(cause, cfg, pipe)
        return exc if explained is cause else explained
    if isinstance(exc, BatchFormError):  # a batch, output or step return of the wrong form (one line)
        return UserCodeError(f"pipeline {cfg.pipeline!r}: {exc}")
    if pipe is not None and _DDP_KEYWORD in str(exc):
        return _unused_parameters(exc, pipe)
    if _not_the_users(exc):
        return exc
    module = pipelines_ref.load(cfg.pipeline)
    roles = _roles(pipe, module)
    own = [getattr(module, "__file__", None) or ""]
    frames = [(f.f_code.co_filename, line, f.f_code) for f, line in traceback.walk_tb(exc.__traceback__)]
    text = str(exc)
    if worker := _WORKER.match(text):  # raised in a loader worker: its frames are in the message
        frames, text = _worker_traceback(text[worker.end() :])
    mine = [(file, line, name) for file, line, name in frames if pipelines_ref.is_user_file(file, own)]
    role = _role(frames, roles, mine)
    if not mine or role is None:
        return exc
    text = " ".join(text.split())
    notes = "".join(f"; {note}" for note in getattr(exc, "__notes__", ()))  # the data's place (baddata)
    at = f"{mine[-1][0]}:{mine[-1][1]}"
    return UserCodeError(f"pipeline {cfg.pipeline!r}: {role} raised {type(exc).__name__}: {text} (at {at}{notes})")


def _worker_traceback(text: str) -> tuple[list[tuple[str, int, str]], str]:
    """A worker's traceback, as torch passes it on: its frames (file, line, function name), and
    the exception's own message (after the frames, less the type's name)."""
    last = text.split("\nTraceback (most recent call last):\n")[-1]  # a chained exception's own
    frames = [(file, int(line), name) for file, line, name in _FRAME.findall(last)]
    lines = last.rstrip("\n").split("\n")
    tail = len(lines)
    while tail and not lines[tail - 1].startswith(" "):
        tail -= 1
    message = "\n".join(lines[tail:])
    return frames, message.split(": ", 1)[1] if ": " in message.split("\n")[0] else ""


def _stage_cause(exc: BaseException) -> BaseException | None:
    """What a pipeline stage's forward raised, where torch's schedule wrapped it ("[Stage 1] failed
    to run forward: args: ...", raised from it), or None."""
    if isinstance(exc, RuntimeError) and exc.__cause__ is not None and _STAGE.match(str(exc)):
        return exc.__cause__
    return None


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


def _role(
    frames: list[tuple[str, int, Any]], roles: dict[CodeType, str], mine: list[tuple[str, int, Any]]
) -> str | None:
    """The contract function the exception left: the outermost frame (file, line, and its code,
    or its function's name when read from a worker's text) that is one of them, else the
    outermost frame of the user's code, by its name."""
    named = next((role for frame in frames if (role := _role_of(frame, roles))), None)
    if named:
        return named
    first = mine[0][2] if mine else None
    return f"{getattr(first, 'co_name', first)}()" if mine else None


def _role_of(frame: tuple[str, int, Any], roles: dict[CodeType, str]) -> str | None:
    file, line, code = frame
    if not isinstance(code, str):
        return roles.get(code)
    return next(
        (
            role
            for own, role in roles.items()
            if own.co_filename == file
            and own.co_name == code
            and own.co_firstlineno <= line <= max((end for *_, end in own.co_lines() if end), default=0)
        ),
        None,
    )


def _roles(pipe: Any, module: Any) -> dict[CodeType, str]:
    """The code of each function of the pipeline's contract -> how a message names it."""
    from raylane.loop.protocols.batches import STEP_ROLE

    named: list[tuple[str, Any]] = [
        ("build(cfg)", getattr(module, "build", None)),
        ("sources(cfg)", getattr(module, "sources", None)),
    ]
    if pipe is not None:
        named += [
            (LOSS_ROLE, pipe.loss_fn),
            (SUMS_ROLE, pipe.eval_sums),
            (STEP_ROLE, pipe.step),
            ("eval_count(batch)", pipe.eval_count),
            (COLLATE_ROLE, pipe.collate_fn),
            (OPTIMIZER_ROLE, pipe.optimizer),
            (SCHEDULER_ROLE, pipe.scheduler),
            ("the model's forward", getattr(type(pipe.model), "forward", None)),
        ]
        named += _hook_roles(pipe.hooks)
        sets = [("train_set", pipe.train_set)]
        sets += (
            [(f"eval_set[{k!r}]", v) for k, v in pipe.eval_set.items()]
            if isinstance(pipe.eval_set, dict)
            else [("eval_set", pipe.eval_set)]
        )
        for name, data in sets:
            if data is None:
                continue
            if hasattr(data, "to_tensors"):  # a FileSource
                named += [
                    (f"{name}'s FileSource.to_tensors", data.to_tensors),
                    (f"{name}'s FileSource.transform", data.transform),
                ]
            else:
                named += [
                    (f"{name}.{method}", getattr(type(data), method, None))
                    for method in ("__getitem__", "__len__", "__iter__")
                ]
    roles: dict[CodeType, str] = {}
    for role, fn in named:
        code = getattr(_function(fn), "__code__", None)
        if code is not None:
            roles.setdefault(code, role)
    return roles


def _hook_roles(hooks: Any) -> list[tuple[str, Any]]:
    """Each hook's own methods (not raylane.Hook's empty ones), named `hook Class.method`."""
    from raylane.loop.protocols.hooks import METHODS, Hook

    named = []
    for hook in hooks or ():
        for method in METHODS:
            fn = getattr(type(hook), method, None)
            if fn is not None and fn is not getattr(Hook, method, None):
                # Unwrapped: decorators (torch.no_grad) share one wrapper's code between methods.
                named.append((f"hook {type(hook).__name__}.{method}", inspect.unwrap(fn)))
    return named


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
    return UserCodeError(
        f"strategy.find_unused_parameters = false: the model's {which} got no gradient at a step"
        f"{where} (not used to compute the loss): set strategy.find_unused_parameters: true, or "
        "use every parameter in forward"
    )


def build_pipeline(cfg: Any) -> Any:
    """`build(cfg)` of the config's pipeline, checked to be a raylane.Pipeline; its exception, or
    a wrong return, is a PipelineBuildError that names the pipeline, what went wrong and where."""
    module = pipelines_ref.load(cfg.pipeline)
    pipe = pipelines_ref.call(cfg, module, "build")
    problem = pipeline_problem(pipe)
    if problem:
        raise PipelineBuildError(
            f"pipeline {cfg.pipeline!r}: build(cfg) returned {problem} (at {pipelines_ref.returned_at(module.build)})"
        )
    return pipe


def pipeline_blocks(cfg: Any) -> Any:
    """`raylane check --blocks`: the blocks of the config's pipeline (raylane.loop.distributed.blocks.Blocks),
    built in this process."""
    from raylane.loop.distributed.blocks import find_blocks

    pipe = build_pipeline(cfg)
    return find_blocks(pipe.model, pipe.blocks)
