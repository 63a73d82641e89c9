"""Before launch: the model's own forward run as one rank of a model-parallel layout runs it, on
the meta device (shapes only, no memory, nothing computed), so that a forward the layout cannot
run is refused in one line before any worker starts, not at the first step on every rank.

- `check_tp_forward`: under tensor parallelism, on one rank's share of the plan: the plan laid
  out for real over a process group of torch's `fake` backend with `tp` ranks (DTensors of one
  rank's shapes, nothing sent), the attentions' head counts made the rank's own
  (raylane.loop.distributed.tensor_parallel.local_heads), then the forward on the example input.
- `check_pp_forward`: under pipeline parallelism, the stages (raylane.loop.distributed.pipeline_parallel)
  run one after the other, each on the model's own input and the activation the stage before
  sent, as the schedule runs them.

A model whose forward does not run on the meta device at all (an op with no meta kernel, a value
read with `.item()`) is not checked here: nothing would tell the layout's failure from the
device's. Each refusal names strategy.tp or strategy.pp, the module that was running, the user's
`file:line`, the error, and what the forward must do."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

log = logging.getLogger("raylane")

TP_FORWARD = (
    "under tensor parallelism a rank's q, k and v hold n_heads / {tp} of the heads: view them with -1 heads, or "
    "with a head count in an attribute raylane divides on a split attention ({attrs}), and a head size set at "
    "init (self.head_dim, not the input's width C // n_heads); join the heads with reshape(B, T, -1) "
    "(docs/strategies.md, Tensor parallelism)"
)
PP_FORWARD = (
    "a stage runs the model's own forward on the model's input, with the blocks of {container!r} iterated in "
    "turn on the running activation, each taking and returning one tensor, and what other stages hold giving "
    "zeros of its shape (docs/strategies.md, Pipeline parallelism)"
)


def check_tp_forward(model: nn.Module, plan: Any, tp: int, example: Any, *, sequence_parallel: bool = False) -> None:
    """ValueError, one line naming strategy.tp, when the model's forward fails on one rank's share
    of `plan` over `tp` ranks (what the run would raise at its first step). Nothing is checked
    where a process group exists already (on the ranks, where the run itself is the check) or
    where the whole model does not run on the meta device."""
    import torch.distributed as dist

    if tp < 2 or example is None or dist.is_initialized() or not _runs_on_meta(model, example):
        return
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the fake backend
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from raylane.loop.distributed.fake import fake_work
    from raylane.loop.distributed.heads import HEAD_COUNTS
    from raylane.loop.distributed.tensor_parallel import apply_plan

    # fake_work: a torchrun rank trains in this process next (its first steps were seen to change)
    with fake_work():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
        try:
            meta = _meta_copy(model)
            mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
            apply_plan(meta, plan, mesh, sequence_parallel=sequence_parallel)
            with _running(meta) as running, torch.no_grad():
                try:
                    _call(meta, example)
                except Exception as exc:  # noqa: BLE001 - any failure of the user's forward, said in one line
                    advice = TP_FORWARD.format(tp=tp, attrs=", ".join(HEAD_COUNTS))
                    raise ValueError(f"strategy.tp = {tp}: {_failed(model, running, exc)}; {advice}") from None
        finally:
            dist.destroy_process_group()


def check_pp_forward(
    model: nn.Module, stages: list[list[str]], container: str, example: Any, pp: int, call: Any = None
) -> None:
    """ValueError, one line naming strategy.pp, when the stages of `model` (split by `stages`, the
    blocks in `container`; `call`: a Stages' own) run in turn on `example` fail, or end in an
    output of another shape than the whole model's. Nothing is checked where the whole model does
    not run on the meta device."""
    from raylane.loop.distributed.pipeline_parallel import MODEL_INPUT, stage_module

    if example is None or not _runs_on_meta(model, example):
        return
    meta = _meta_copy(model)
    with torch.no_grad():
        whole = _call(meta, example)
        x: Any = _on_meta(example)
        for index in range(len(stages)):
            stage = stage_module(meta, stages, index, container, call)
            with _running(stage) as running:
                try:
                    x = stage(x, **({} if call is not None else {MODEL_INPUT: _on_meta(example)}))
                except Exception as exc:  # noqa: BLE001 - any failure of the user's forward, said in one line
                    what = _failed(model, running, exc, f"stage {index} of ")
                    raise ValueError(f"strategy.pp = {pp}: {what}; {PP_FORWARD.format(container=container)}") from None
    if isinstance(whole, torch.Tensor) and (not isinstance(x, torch.Tensor) or x.shape != whole.shape):
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"strategy.pp = {pp}: the stages of {type(model).__name__} run in turn give {got}, its forward "
            f"{tuple(whole.shape)}; {PP_FORWARD.format(container=container)}"
        )


def _runs_on_meta(model: nn.Module, example: Any) -> bool:
    try:
        with torch.no_grad():
            _call(_meta_copy(model), example)
    except Exception as exc:  # noqa: BLE001 - whatever the meta device cannot run
        log.debug("the model-parallel forward check skips %s: %s: %s", type(model).__name__, type(exc).__name__, exc)
        return False
    return True


def _meta_copy(model: nn.Module) -> nn.Module:
    from raylane.loop.distributed.fake import meta_copy

    return meta_copy(model)[0]


def _call(model: nn.Module, example: Any) -> Any:
    """The model's output for its example input (the forms of raylane.loop.protocols.pipeline.example_batch)."""
    example = _on_meta(example)
    if isinstance(example, Mapping):
        return model(**example)
    if isinstance(example, (tuple, list)):
        return model(*example)
    return model(example)


def _on_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, Mapping):
        return {k: _on_meta(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_on_meta(v) for v in value)
    return value


@contextlib.contextmanager
def _running(model: nn.Module) -> Iterator[list[str]]:
    """The names of the modules running, outermost first: on an exception, the chain down to
    the innermost module whose forward raised."""
    stack: list[str] = []

    def left(*_: Any) -> None:  # a hook's return value would replace the module's output
        stack.pop()

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(lambda *_, n=name: stack.append(n)))
            handles.append(module.register_forward_hook(left))
    try:
        yield stack
    finally:
        for handle in handles:
            handle.remove()


def _failed(model: nn.Module, running: list[str], exc: BaseException, prefix: str = "") -> str:
    from raylane.pipelines_ref import user_frame

    where = user_frame(exc, _class_files(model)) or _innermost(exc)
    inside = f" in {running[-1]}" if running else ""
    text = " ".join(str(exc).split())
    return f"{prefix}{type(model).__name__}'s forward fails{inside} ({where}): {type(exc).__name__}: {text}"


def _class_files(model: nn.Module) -> set[str]:
    """The files the model's module classes are defined in: the user's code, wherever it lives."""
    import inspect
    import os

    files = set()
    for kind in {type(m) for m in model.modules()}:
        with contextlib.suppress(TypeError, OSError):
            files.add(inspect.getfile(kind))
    libraries = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
    return {f for f in files if not any(lib in f for lib in libraries)}


def _innermost(exc: BaseException) -> str:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "unknown location"


def check_model_parallel(pipe: Any, cfg: Any) -> None:
    """Before launch, on the pipeline `build(cfg)` made (on the meta device, or not): what the
    config's model-parallel layout needs of its model's forward. ValueError, one line: sequence
    parallelism with a plan that cannot lay it out (raylane.loop.distributed.tensor_parallel.
    check_sequence_parallel); a forward that fails on one rank's share of the tp_plan at a fixed
    `strategy.tp`; stages that fail run in turn under `strategy.pp`. What the pipeline lacks (no
    tp_plan, no pp_stages) is raylane.layout_checks' to say, and a split that cannot work
    raylane.loop.distributed.pipeline_split's."""
    from raylane.loop.distributed.blocks import find_blocks
    from raylane.loop.distributed.pipeline_parallel import Stages
    from raylane.loop.distributed.pipeline_split import split_names
    from raylane.loop.distributed.tensor_parallel import check_sequence_parallel
    from raylane.loop.protocols.pipeline import example_batch

    s = cfg.strategy
    plan = pipe.tp_plan if s.tensor_parallel else None
    if plan is not None and s.sequence_parallel:
        check_sequence_parallel(pipe.model, plan)
    try:
        example = example_batch(pipe)
    except ValueError:  # no example to run: the run itself will tell
        return
    if plan is not None and s.tp != "auto":
        check_tp_forward(pipe.model, plan, s.tp, example, sequence_parallel=s.sequence_parallel)
    if s.pp > 1 and pipe.pp_stages is not None:
        split = pipe.pp_stages if isinstance(pipe.pp_stages, Stages) else Stages(pipe.pp_stages)
        if split.call is not None:  # its first stage takes what its pair makes of a batch, not the example
            return  # (raylane.hf's stages were refused: 'embedding(): argument indices must be Tensor, not dict')
        found = find_blocks(pipe.model, pipe.blocks)
        stages, container = split_names(pipe.model, found, split.names, s.pp * s.stages_per_rank)
        check_pp_forward(pipe.model, stages, container, example, s.pp, split.call)
