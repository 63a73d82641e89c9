"""Pipeline parallelism from a pipeline's `pp_stages`: the model cut into stages by module name,
each rank holding its stages (torch.distributed.pipelining's PipelineStage), run by one of torch's
schedules. Names stay the model's (`blocks.5` stays `blocks.5` on whichever stage holds it), so a
checkpoint loads at any layout. Which names each stage holds: raylane.loop.distributed.pipeline_split.

A stage is the model itself, deep-copied, with what other stages hold taken out (torchtitan's
way), so that the model's own `forward` runs unchanged on every stage:

- blocks of other stages leave the blocks' container: iterating it yields this stage's only;
- every stage's forward is called with the model's own input (the micro-batch's, which every rank
  of a pipeline reads: nothing more is sent), so `B, T = idx.shape`, positions and masks made
  from it are what they are on one process;
- other modules that hold parameters become `Elsewhere`, which returns zeros of the shape the
  module would return (a stride-0 view: no memory), so `B, T, C = x.shape` after them holds too;
- on a stage after the first, iterating the blocks first yields `Enter`, which hands the first
  block the activation the stage received (whatever the forward computed before it is discarded);
- on a stage before the last, iterating them last yields `Exit`, which ends the forward there
  with the last block's output.

So a model written the natural way, `B, T = idx.shape; x = embed(idx) + pos(arange(T)); for
block in self.blocks: x = block(x); return head(norm(x))`, pipelines with `pp_stages="auto"`.
Its blocks must be called in turn on the running activation, each taking and returning one
tensor; parameter-free modules (dropout, rotary tables) run on every stage."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raylane.config import BaseConfig
from raylane.loop.distributed.blocks import Blocks
from raylane.loop.distributed.fsdp import Strategy, fully_shard, prepare_blocks
from raylane.loop.distributed.pipeline_split import is_under, split_names
from raylane.loop.distributed.tensor_parallel import apply_rules, plan_for


class StageExit(Exception):  # noqa: N818 - control flow, not an error: the stage's output
    """Raised by `Exit` with the last block's output: the stage's forward ends there."""

    def __init__(self, output: Any) -> None:
        super().__init__("pipeline stage output")
        self.output = output


# The keyword under which a stage's forward gets the micro-batch's own input (torch's schedules
# split keyword arguments into micro-batches and hand them to every stage, the first included).
MODEL_INPUT = "raylane_model_input"


class Elsewhere(nn.Module):
    """A module another stage holds: its output here is zeros of the shape it would have (worked
    out by its copy on the meta device), which `Enter` discards; a scalar zero where the meta
    copy cannot run."""

    def __init__(self, module: nn.Module | None = None) -> None:
        super().__init__()
        # not a submodule: its parameters are another stage's (and on the meta device, no memory)
        object.__setattr__(self, "shape_of", module.to("meta") if module is not None else None)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        like = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        device = like.device if like is not None else None
        zero = torch.zeros((), device=device)
        if self.shape_of is None:
            return zero
        try:
            with torch.no_grad():
                out = self.shape_of(*_on_meta(args), **_on_meta(kwargs))
        except Exception:  # noqa: BLE001 - a module that reads values: the scalar zero, as before
            return zero
        if not isinstance(out, torch.Tensor):
            return zero
        return torch.zeros((), dtype=out.dtype, device=device).expand(out.shape)


def _on_meta(values: Any) -> Any:
    if isinstance(values, torch.Tensor):
        return values.to("meta")
    if isinstance(values, dict):
        return {k: _on_meta(v) for k, v in values.items()}
    if isinstance(values, (list, tuple)):
        return type(values)(_on_meta(v) for v in values)
    return values


@dataclass
class _Slot:
    received: Any = None


class Enter(nn.Module):
    def __init__(self, slot: _Slot) -> None:
        super().__init__()
        self.slot = slot

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.slot.received


class Exit(nn.Module):
    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        raise StageExit(x)


class _StageBlocks:
    """Mixed into a stage's blocks container: iteration yields Enter, this stage's blocks, Exit.
    A slice (`self.layers[: config.num_hidden_layers]`, transformers' loop) is taken by the
    model's own positions, and iterates alike."""

    _modules: dict[str, nn.Module]  # the container's own (nn.ModuleList's, mixed with this)
    _stage_keys: list[str]

    def __iter__(self):
        if self._stage_enter is not None:
            yield self._stage_enter
        yield from self._modules.values()
        if self._stage_exit is not None:
            yield self._stage_exit

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, slice):
            return super().__getitem__(index)  # type: ignore[misc]
        wanted = set(self._stage_keys[index])
        view = copy.copy(self)  # the same blocks, Enter and Exit; its own list of them
        view.__dict__["_modules"] = {k: m for k, m in self._modules.items() if k in wanted}
        return view


class _StageForward:
    """A stage's forward: the model's own, given the received activation, ended by Exit.
    `call(forward, x, first)`: how a stage's input reaches the model's forward and what of its
    output the stage sends (raylane.hf.pipeline_parallel: input_ids or inputs_embeds in, logits out)."""

    def __init__(self, forward: Any, slot: _Slot, call: Callable | None = None, first: bool = False) -> None:
        self.forward, self.slot, self.call, self.first = forward, slot, call, first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        given = kwargs.pop(MODEL_INPUT, None)
        self.slot.received = args[0] if args else next(iter(kwargs.values()), None)
        try:
            if self.call is not None:
                return self.call(self.forward, *args, first=self.first, **kwargs)
            if given is not None and not self.first:
                # the model's forward as on one process, on its own input; Enter swaps in what
                # this stage received where the blocks begin
                return self.forward(given, **kwargs)
            return self.forward(*args, **kwargs)
        except StageExit as done:
            return done.output
        finally:
            self.slot.received = None


@dataclass
class Stages:
    """A `Pipeline.pp_stages` for a model whose own forward needs help to run as a stage (a
    Hugging Face causal LM: raylane.hf.pipeline_parallel): the split (`names`: "auto" or lists of module
    names, as `pp_stages` itself), `call(forward, x, first=...)` (the stage's input to the model's
    forward, and the output it sends on), `pair(batch)` ((input, target) of a batch of the
    pipeline's form) and `loss_fn(output, target)` (the last stage's, in place of the pipeline's)."""

    names: str | Sequence[Sequence[str]] = "auto"
    call: Callable[..., Any] | None = None
    pair: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None


def stage_ranks(pp: int, stages_per_rank: int, v_shaped: bool) -> list[int]:
    """The pipeline rank of each stage: looped (rank r holds r, r + pp, ...), or V-shaped (rank r
    holds r and 2 pp - 1 - r, so the first rank holds the first and the last stage)."""
    n = pp * stages_per_rank
    if v_shaped:
        return [s if s < pp else 2 * pp - 1 - s for s in range(n)]
    return [s % pp for s in range(n)]


def stage_module(
    model: nn.Module, stages: list[list[str]], index: int, container: str, call: Callable | None = None
) -> nn.Module:
    """Stage `index` of `model` (split by `stages`): a deep copy holding its own modules only, under
    their names in the model. `container`: the dotted path of the blocks' ModuleList or Sequential;
    `call`: a Stages' (None: the stage's input is the forward's)."""
    stage = copy.deepcopy(model)
    keys = list(stage.get_submodule(container)._modules)
    own = stages[index]
    slot = _Slot()
    for i, names in enumerate(stages):
        if i == index:
            continue
        for name in names:
            if any(is_under(name, mine) for mine in own):
                continue  # inside a module this stage holds
            parent, _, child = name.rpartition(".")
            holder = stage.get_submodule(parent)
            if parent == container:
                del holder._modules[child]
            elif next((module := holder.get_submodule(child)).parameters(), None) is not None:
                holder._modules[child] = Elsewhere(module)
    blocks = stage.get_submodule(container)
    if not any(n.rpartition(".")[0] == container for n in own):
        raise ValueError(f"Pipeline.pp_stages: stage {index} holds no block of {container!r}")
    blocks.__class__ = type(f"Stage{type(blocks).__name__}", (_StageBlocks, type(blocks)), {})
    object.__setattr__(blocks, "_stage_enter", Enter(slot) if index > 0 else None)
    object.__setattr__(blocks, "_stage_exit", Exit() if index < len(stages) - 1 else None)
    object.__setattr__(blocks, "_stage_keys", keys)
    stage.forward = _StageForward(stage.forward, slot, call, first=index == 0)
    return stage


def stage_plan(stage: nn.Module, rules: dict[str, Any]) -> dict[str, Any]:
    """The rules of a tensor-parallel plan that name a module this stage holds."""
    held = [
        n.split(".")
        for n, m in stage.named_modules()
        if n and not isinstance(m, Elsewhere) and not any(is_under(n, e) for e in _elsewhere(stage))
    ]
    out = {}
    for pattern, style in rules.items():
        atoms = pattern.split(".")
        if any(len(n) == len(atoms) and all(map(fnmatch, n, atoms)) for n in held):
            out[pattern] = style
    return out


def _elsewhere(stage: nn.Module) -> list[str]:
    return [n for n, m in stage.named_modules() if isinstance(m, Elsewhere)]


class PipelineModel(nn.Module):
    """This rank's stages as one model, for what sees the model whole (the optimizer, checkpoints,
    train and eval modes): its parameters under the model's own names. Training and evaluation
    go through `pipeline` (a `Pipeline`), never through `forward`."""

    def __init__(self, stages: list[nn.Module], pipeline: Any) -> None:
        super().__init__()
        for stage in stages:
            _merge(self, stage)
        object.__setattr__(self, "stages", stages)  # not submodules: their names would prefix the model's
        object.__setattr__(self, "pipeline", pipeline)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "a pipeline-parallel model runs through its schedule (raylane.loop.distributed.pipeline_parallel)"
        )

    def train(self, mode: bool = True) -> PipelineModel:
        super().train(mode)
        for stage in self.stages:
            stage.train(mode)
        return self

    def set_requires_gradient_sync(self, requires: bool) -> None:
        for stage in self.stages:
            if hasattr(stage, "set_requires_gradient_sync"):
                stage.set_requires_gradient_sync(requires)

    def reshard(self) -> None:
        for stage in self.stages:
            if callable(reshard := getattr(stage, "reshard", None)):
                reshard()


def _merge(into: nn.Module, stage: nn.Module) -> None:
    """`stage`'s modules into `into` under the same names; containers two stages share (the
    blocks') become one holding both stages' blocks."""
    for name, child in stage.named_children():
        mine = into._modules.get(name)
        if isinstance(child, Elsewhere):
            continue
        if mine is None or isinstance(mine, Elsewhere):
            into._modules[name] = child
        elif mine is not child:
            if not isinstance(mine, _Holder):
                held, mine = mine, _Holder()
                _merge(mine, held)
                into._modules[name] = mine
            _merge(mine, child)


class _Holder(nn.Module):
    """Two stages' copies of one container (the blocks'), merged."""


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its stages (index, module), the schedule, the pipeline's
    process group, and the loss the schedule runs (`loss_fn` scaled by `divisor`)."""

    stages: list[tuple[int, nn.Module]]
    n_stages: int
    ranks: list[int]  # the pipeline rank of each stage
    group: Any
    loss_fn: Any
    schedule: Any = None
    microbatches: int = 1
    divisor: float = 1.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    pair: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=lambda: pair)

    @property
    def has_first(self) -> bool:
        return any(i == 0 for i, _ in self.stages)

    @property
    def has_last(self) -> bool:
        return any(i == self.n_stages - 1 for i, _ in self.stages)

    def scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # The schedule sums its micro-batches' gradients (scale_grads=False: torch's default divides
        # every step() by the micro-batches, and accumulated steps again, issue 49's trap d).
        return self.loss_fn(output, target) / self.divisor

    def train_step(self, batches: list[Any]) -> torch.Tensor:
        """One optimizer step's (input, target) batches through the schedule, gradients summed as
        one process's mean over them; the sum of the batches' mean losses on the last stage, else 0."""
        n = len(batches)
        self.divisor = float(self.microbatches * n)
        total = torch.zeros((), device=self.device)
        for batch in batches:
            source, target = self.pair(batch)
            losses: list[torch.Tensor] = []  # fresh each step: the schedule clears the list it is given
            source = source.to(self.device)
            args = (source,) if self.has_first else ()
            target = target.to(self.device) if self.has_last else None
            self.schedule.step(*args, target=target, losses=losses, **{MODEL_INPUT: source})
            if losses:
                total = total + torch.stack([x.detach() for x in losses]).sum() * n
        return total

    @torch.no_grad()
    def forward_only(self, source: torch.Tensor) -> torch.Tensor | None:
        """The model's output for a whole batch, stage after stage with no micro-batches (any
        batch size, every schedule): on the rank holding the last stage; None elsewhere.

        Not torch's `schedule.eval()` (torch 2.13, tried on 2 gloo ranks, issue 61): it gives the
        same outputs (bit for bit) for a batch of the training step's shape only, since its
        stages keep the shapes they inferred at the first step: an epoch's last, smaller
        held-out batch (7 rows after steps of 8) came back as 8 rows, silently, and one larger
        failed; under ZBVZeroBubble and DualPipeV it fails ('can't steal_bwd_input if this stage
        doesn't have backward'). A schedule per batch shape, and another for V-shaped stages,
        would be more code than this forward."""
        mine = dict(self.stages)
        me = dist.get_rank(self.group)
        source = source.to(self.device)
        x: Any = source
        for s in range(self.n_stages):
            if s not in mine:
                continue
            if s > 0 and self.ranks[s - 1] != me:
                x = _recv(self.ranks[s - 1], self.group, self.device)
            x = mine[s](x, **{MODEL_INPUT: source})
            if s == self.n_stages - 1:
                return x
            if self.ranks[s + 1] != me:
                _send(x, self.ranks[s + 1], self.group)
        return None


def pair(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An (input, target) batch of tensors, the one form a pipeline schedule runs; else one line."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return batch[0], batch[1]
    from raylane.loop.protocols.batches import BatchFormError, describe

    raise BatchFormError(
        f"strategy.pp: a pipeline schedule runs (input, target) batches of two tensors through loss_fn; "
        f"this batch is {describe(batch)}"
    )


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32]
_HEADER = 10  # dtype, dimensions, up to 8 sizes


def _send(x: torch.Tensor, to: int, group: Any) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() > _HEADER - 2 or x.dtype not in _DTYPES:
        raise TypeError(f"a pipeline stage's output must be one tensor of at most 8 dimensions, not {type(x).__name__}")
    x = x.full_tensor() if hasattr(x, "full_tensor") else x
    header = torch.zeros(_HEADER, dtype=torch.int64, device=x.device)
    header[0], header[1] = _DTYPES.index(x.dtype), x.dim()
    header[2 : 2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    peer = dist.get_global_rank(group, to)
    dist.send(header, peer, group=group)
    dist.send(x.contiguous(), peer, group=group)


def _recv(source: int, group: Any, device: torch.device) -> torch.Tensor:
    peer = dist.get_global_rank(group, source)
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    dist.recv(header, peer, group=group)
    dims = int(header[1])
    x = torch.empty(header[2 : 2 + dims].tolist(), dtype=_DTYPES[int(header[0])], device=device)
    dist.recv(x, peer, group=group)
    return x


def build_schedule(pipeline: Pipeline, name: str, microbatches: int) -> Any:
    """torch's schedule `name` over this rank's stages, summing the micro-batches' gradients."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    stages = [
        PipelineStage(module, index, pipeline.n_stages, pipeline.device, group=pipeline.group)
        for index, module in pipeline.stages
    ]
    cls = get_schedule_class(name)
    single = issubclass(cls, PipelineScheduleSingle)
    return cls(
        stages[0] if single else stages, n_microbatches=microbatches, loss_fn=pipeline.scaled_loss, scale_grads=False
    )


def lay_out_pipeline_parallel(
    model: nn.Module, found: Blocks, cfg: BaseConfig, device: torch.device, strategy: Strategy, plan, stages, loss_fn
) -> nn.Module:
    """A run's layout step under `strategy.pp`: this rank's pipeline stages, each in issue 49's
    order: the split (on the model as built, on the meta device or not), the TP plan and its ties,
    recompute and compile, FSDP2 (over one rank too: every parameter a DTensor, so a checkpoint is
    sharded by stage), then storage."""
    layout = strategy.layout
    mesh = layout.device_mesh(device.type)
    rules = plan_for(model, plan, sequence_parallel=layout.sequence_parallel) if layout.tp > 1 else None

    def prepare(stage: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        if rules is not None:  # the plan's rules for the modules this stage holds
            apply_rules(stage, stage_plan(stage, rules), mesh["tp"])
        prepare_blocks(stage, cfg, blocks)
        return fully_shard(stage, blocks, cfg, device, strategy, layout.fsdp_mesh(mesh))

    return pipeline_model(model, found, cfg.strategy, device, mesh["pp"], prepare, stages, loss_fn)


def pipeline_model(
    model: nn.Module,
    found: Blocks,
    s: Any,
    device: torch.device,
    pp_mesh: Any,
    prepare: Any,
    pp_stages: Any,
    loss_fn: Any,
) -> PipelineModel:
    """This rank's stages of `model` (`s`: the strategy section), each made ready by
    `prepare(stage, its blocks)` (`lay_out_pipeline_parallel`'s: the TP plan, recompute, compile, FSDP2),
    and the schedule over them on the pipeline's mesh `pp_mesh`."""
    if pp_stages is None:
        raise ValueError(
            f"strategy.pp = {s.pp}: the pipeline gives no pp_stages (how its model splits into stages): give "
            "its Pipeline pp_stages='auto' or lists of module names (docs/strategies.md, Pipeline parallelism)"
        )
    if loss_fn is None and not (isinstance(pp_stages, Stages) and pp_stages.loss_fn):
        raise ValueError(
            f"strategy.pp = {s.pp}: pipeline parallelism runs (input, target) batches and the pipeline's "
            "loss_fn on the last stage; the pipeline gives no loss_fn"
        )
    split = pp_stages if isinstance(pp_stages, Stages) else Stages(pp_stages)
    loss_fn = split.loss_fn or loss_fn
    n = s.pp * s.stages_per_rank
    stages, container = split_names(model, found, split.names, n)
    ranks = stage_ranks(s.pp, s.stages_per_rank, s.pp_schedule in ("ZBVZeroBubble", "DualPipeV"))
    me = pp_mesh.get_local_rank()
    held = []
    for index in (i for i, r in enumerate(ranks) if r == me):
        stage = stage_module(model, stages, index, container, split.call)
        blocks = [m for m in stage.get_submodule(container)._modules.values() if any(True for _ in m.parameters())]
        held.append((index, prepare(stage, blocks)))
    pipe = Pipeline(held, n, ranks, pp_mesh.get_group(), loss_fn, microbatches=s.microbatches, device=device)
    pipe.pair = split.pair or pair
    pipe.schedule = build_schedule(pipe, s.pp_schedule, s.microbatches)
    whole = PipelineModel([m for _, m in held], pipe)
    for key, value in vars(model).items():  # raylane's records on the model (its frozen base, tokenizer)
        if key.startswith("_raylane_"):
            object.__setattr__(whole, key, value)
    return whole
