"""`raylane check --plan`: the layout a config asks for (`fsdp×tp2 on 4 ranks: dp 2 × tp 2`), its
pipeline stages under `strategy.pp` (each stage's modules and parameters), and the pipeline's
tensor-parallel plan on its model, built on the meta device (shapes, no memory, no
process group): which modules each rule takes and how their weights are split, what every rank of
a tensor-parallel group holds whole, and the parameters held under several names (tied), which
must be split alike. A rule that names no module, or tied names split two ways, is an error here
as it would be on the ranks."""

from __future__ import annotations

import re
from collections.abc import Iterable
from fnmatch import fnmatch
from typing import Any

from torch import nn

from raylane.loop.mesh import model_parallel_strategy
from raylane.loop.tensor_parallel import plan_for, shared_parameters


def layout_line(cfg: Any, world: int) -> str:
    """The layout of `cfg` on `world` ranks, as the run's strategy line names it."""
    s = cfg.strategy
    ranks = f"{world} rank{'s' if world != 1 else ''}"
    if s.tp == "auto":
        return f"{s.name} on {ranks}: tp chosen on the ranks (strategy.tp = auto: the simplest layout that fits)"
    if s.tp == 1 and s.pp == 1:
        name = "single" if world == 1 else s.name
        return f"{name} on {ranks}: dp {world} (strategy.tp = 1: every rank holds whole layers)"
    strategy = model_parallel_strategy(cfg, world)
    dims = [f"dp {strategy.data_parallel}"] + [f"{d} {n}" for d, n in (("tp", s.tp), ("pp", s.pp)) if n > 1]
    return f"{strategy.label} on {ranks}: {' × '.join(dims)}"


def plan_lines(model: nn.Module, plan: Any, *, sequence_parallel: bool) -> list[str]:
    """The plan on `model`: a line per rule (its modules, blocks' indices folded into `*`, and
    their split), then what stays whole and what is tied. ValueError, one line, for a rule that
    names nothing or tied names split differently."""
    rules = plan_for(model, plan, sequence_parallel=sequence_parallel)
    modules = dict(model.named_modules())
    placed: dict[str, str] = {}  # parameter name -> its layout over the tensor-parallel ranks
    rows: dict[tuple[str, str], int] = {}
    for pattern, style in rules.items():
        for name in (n for n in modules if _matches(n, pattern)):
            text, params = describe(style, modules[name])
            placed |= {f"{name}.{p}": where for p, where in params.items()}
            key = (_folded(name), text)
            rows[key] = rows.get(key, 0) + 1
    width = max((len(path) for path, _ in rows), default=0)
    lines = [f"plan on {type(model).__name__} ({len(rules)} rules):"]
    lines += [f"  {path:{width}}  {text}" + (f"  (×{n})" if n > 1 else "") for (path, text), n in rows.items()]
    whole = [name for name, _ in model.named_parameters() if placed.get(name, "whole") == "whole"]
    lines.append("whole on every tensor-parallel rank: " + (_grouped(whole) or "nothing"))
    for names in shared_parameters(model):
        layouts = {placed.get(n, "whole") for n in names}
        if len(layouts) > 1:
            raise ValueError(
                f"Pipeline.tp_plan: {' and '.join(names)} are one tied parameter, which the plan lays out as "
                f"{' and '.join(placed.get(n, 'whole') for n in names)}; give both the same sharding"
            )
        lines.append(f"tied: {' = '.join(names)} (one parameter, {layouts.pop()})")
    return lines


def describe(style: Any, module: nn.Module) -> tuple[str, dict[str, str]]:
    """(the style in words, {its parameter: layout}) for one module a rule takes."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    own = [n for n, _ in module.named_parameters(recurse=False)]
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        colwise = isinstance(style, ColwiseParallel)
        embedding = isinstance(module, nn.Embedding)
        # Linear weights are (out, in): columns of the output are rows of the weight.
        dim = (1 if colwise else 0) if embedding else (0 if colwise else 1)
        params = {n: f"Shard({dim})" if n == "weight" or colwise else "whole" for n in own}
        layouts = f"in {_layout(style.input_layouts)}, out {_layout(style.output_layouts)}"
        return f"{'colwise' if colwise else 'rowwise'}: weight Shard({dim}); {layouts}", params
    if isinstance(style, SequenceParallel):
        return "sequence parallel: weights whole, tokens Shard(1)", {n: "whole" for n in own}
    if isinstance(style, PrepareModuleInput) and style.input_layouts:
        return f"inputs {_layout(style.input_layouts)} -> {_layout(style.desired_input_layouts or ())}", {}
    return type(style).__name__, {}


def _layout(layouts: Iterable[Any]) -> str:
    return ", ".join(f"Shard({p.dim})" if hasattr(p, "dim") else type(p).__name__ for p in layouts if p is not None)


def _matches(name: str, pattern: str) -> bool:
    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(map(fnmatch, parts, atoms))


def _folded(name: str) -> str:
    """A module's path with its block's index as `*` (`blocks.*.mlp.0`): the first index in it."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name, count=1)


def _grouped(names: list[str]) -> str:
    counts: dict[str, int] = {}
    for name in names:
        counts[_folded(name)] = counts.get(_folded(name), 0) + 1
    return ", ".join(path + (f" (×{n})" if n > 1 else "") for path, n in counts.items())


def stage_lines(pipe: Any, cfg: Any) -> list[str]:
    """With `strategy.pp` > 1: a line per pipeline stage, its rank, its modules (a run of blocks
    folded, `blocks.0-3`) and its parameters. ValueError, one line, for a split that cannot work."""
    from raylane import pipelines_ref
    from raylane.loop.blocks import find_blocks
    from raylane.loop.pipeline_parallel import Stages, stage_ranks
    from raylane.loop.pipeline_split import split_names

    s = cfg.strategy
    if pipe.pp_stages is None:
        raise ValueError(
            f"strategy.pp = {s.pp}: the {pipelines_ref.label(cfg.pipeline)} pipeline gives no pp_stages (how its "
            "model splits into stages): give its Pipeline pp_stages='auto' or lists of module names"
        )
    names = pipe.pp_stages.names if isinstance(pipe.pp_stages, Stages) else pipe.pp_stages
    n = s.pp * s.stages_per_rank
    stages, container = split_names(pipe.model, find_blocks(pipe.model, pipe.blocks), names, n)
    ranks = stage_ranks(s.pp, s.stages_per_rank, s.pp_schedule in ("ZBVZeroBubble", "DualPipeV"))
    params = dict(pipe.model.named_parameters())
    lines = [f"stages of {type(pipe.model).__name__} ({n}, {s.pp_schedule}):"]
    for index, held in enumerate(stages):
        count = sum(p.numel() for name, p in params.items() if any(name.startswith(m + ".") for m in held))
        lines.append(
            f"  stage {index} (pp rank {ranks[index]}): {_folded_run(held, container)}  ({count:,} parameters)"
        )
    return lines


def _folded_run(names: list[str], container: str) -> str:
    """Module names, consecutive blocks of `container` as one `container.first-last`."""
    out: list[str] = []
    run: list[int] = []
    prefix = f"{container}." if container else ""

    def flush() -> None:
        if run:
            out.append(f"{prefix}{run[0]}" if len(run) == 1 else f"{prefix}{run[0]}-{run[-1]}")
            run.clear()

    for name in names:
        rest = name[len(prefix) :] if name.startswith(prefix) else ""
        if rest.isdigit() and (not run or int(rest) == run[-1] + 1):
            run.append(int(rest))
            continue
        flush()
        if rest.isdigit():
            run.append(int(rest))
        else:
            out.append(name)
    flush()
    return ", ".join(out)


def pipeline_plan(cfg: Any, world: int) -> list[str]:
    """`raylane check --plan`: the layout line, the stages (with `strategy.pp` > 1) and the plan of
    the config's pipeline, its `build(cfg)` run in this process with the meta device as the default (the model's shapes, no
    memory). ValueError, one line, for a plan that cannot be laid out on the model."""
    import torch

    from raylane import pipelines_ref
    from raylane.loop.usercode import build_pipeline

    with torch.device("meta"):
        pipe = build_pipeline(cfg)
    lines = [f"layout: {layout_line(cfg, world)}"]
    if cfg.strategy.pp > 1:
        lines += stage_lines(pipe, cfg)
    if pipe.tp_plan is None:
        return [*lines, f"plan: none (the {pipelines_ref.label(cfg.pipeline)} pipeline gives no tp_plan)"]
    plan, sp = pipe.tp_plan, cfg.strategy.sequence_parallel
    if callable(plan):
        try:
            plan = plan(pipe.model, sp)
        except ValueError as exc:  # the model has none (a Hugging Face model transformers gives none)
            if cfg.strategy.tp_degree > 1:
                raise
            # What strategy.tp > 1 would refuse (its advice after "; "): tp 1 needs no plan.
            return [*lines, f"plan: none ({str(exc).split('; ')[0]})"]
    return lines + plan_lines(pipe.model, plan, sequence_parallel=sp)
