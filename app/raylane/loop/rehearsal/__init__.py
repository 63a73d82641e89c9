"""`raylane check CONFIG --world N --nodes M --gpu MODEL`: the run rehearsed at its full size in
this one process. The config is taken at N ranks, its model built on the meta device
(raylane.loop.meta_build: shapes, no memory), and the ranks whose shares can differ played in
turn on torch's `fake` process group (raylane.loop.rehearsal.ranks), each laid out by raylane's own
`parallelize`; then one rank's activations, its memory against the GPU's, the mesh and which of
its dimensions cross nodes, the batch, the step's estimated time, a checkpoint's files and bytes
per save, and MLflow's entries per logging window (raylane.loop.rehearsal.figures).

What would fail at N is a ConfigError, one line naming the key (the CLI exits 2): sizes N does not
divide, a global batch N does not split, a tensor-parallel group across nodes, a rank over its
GPU's memory, a global batch larger than the data. What is merely slow or wasteful is a warning
line. torchtitan's `COMM_MODE=fake_backend` is the same idea (its docs/debugging.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raylane.errors import ConfigError
from raylane.loop.distributed.devices import size_text
from raylane.loop.rehearsal import figures
from raylane.loop.rehearsal.ranks import Share, lay_out, ranks_to_play
from raylane.loop.rehearsal.target import MFU, Target, check_nodes, mesh_line, target_of

# The nodes whose health MLflow records one by one (raylane.tracking.health.MAX_NODE_SERIES, a
# layer above the loop; tests/unit/test_rehearse.py holds the two equal).
NODE_SERIES = 8

__all__ = ["Rehearsal", "Target", "at_size", "rehearse", "target_of"]

# The share of a GPU's memory a rank may plan to fill: raylane's own (parallelize.AUTO_MARGIN,
# what `strategy: auto` keeps free for fragmentation, the CUDA context and kernels' workspaces).
USABLE = 0.85


@dataclass
class Rehearsal:
    """What `raylane check --world` prints: its lines, and the warnings (merely slow or wasteful)."""

    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    shares: list[Share] = field(default_factory=list)
    memory: dict[int, figures.Memory] = field(default_factory=dict)


def at_size(cfg: Any, target: Target) -> Any:
    """`cfg` at the target's world, its checks run again there, and its device memory the GPU's
    (what `strategy: auto` weighs); ConfigError naming the key where the config does not hold at N
    (sizes it does not divide: raylane.layout_checks; a global batch it does not split)."""
    from raylane.config.batching import held_batch
    from raylane.layout_checks import check_layout

    raw = cfg.model_dump()
    raw["scaling"] |= {"num_workers": target.world, "min_workers": None}
    raw["scaling"]["device_memory_gb"] = raw["scaling"].get("device_memory_gb") or target.memory_bytes / 2**30
    sized = _validated(type(cfg), raw, target)
    check_layout(sized, target.world, f"--world {target.world}")
    # The global batch held at N sets batch_size or grad_accum_steps there: the config's checks
    # again on what that gives (a pipeline's micro-batches must divide the batch_size it gets).
    return _validated(type(cfg), held_batch(sized, target.world).model_dump(), target)


def _validated(cls: Any, raw: dict[str, Any], target: Target) -> Any:
    from pydantic import ValidationError

    from raylane.config.load import format_validation_error

    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"at --world {target.world}: {format_validation_error(exc, cls)}") from None


def rehearse(cfg: Any, target: Target) -> Rehearsal:
    """The rehearsal of `cfg` at `target` (see the module's docstring); ConfigError for what would fail."""
    from raylane.loop.distributed.layout import Layout
    from raylane.loop.meta_build import Unchecked, build_for_checks
    from raylane.pipelines_ref import UserCodeError

    cfg = at_size(cfg, target)
    s = cfg.strategy
    if s.tp_degree > 1 or s.pp > 1:  # tp auto chooses within a node by itself
        check_nodes(Layout.model_parallel_of(s, target.world), target)
    try:
        pipe = build_for_checks(cfg)
    except (UserCodeError, Unchecked) as exc:
        raise ConfigError(str(exc)) from None
    out = Rehearsal()
    example = _example(pipe, cfg)
    first = lay_out(pipe, cfg, target, 0, example if "auto" in (s.name, s.tp) else None)
    others = _as_chosen(cfg, first.layout)
    out.shares = [first] + [lay_out(pipe, others, target, r) for r in ranks_to_play(first.layout)[1:]]
    layout = first.layout
    check_nodes(layout, target)  # the degree tp auto chose, too
    _describe(out, pipe, cfg, target, layout)
    _weigh(out, pipe, cfg, target, layout, example)
    _batch_and_step(out, pipe, cfg, target, layout)
    _records(out, pipe, cfg, target, layout)
    return out


def _as_chosen(cfg: Any, layout: Any) -> Any:
    """`cfg` with what rank 0 chose where it says `auto`, for the other ranks played: on the ranks,
    rank 0's choice is broadcast (parallelize._agreed), and each rank's own measure of its shard
    (a last shard holds less) could choose otherwise."""
    s = cfg.strategy
    if "auto" not in (s.name, s.tp):
        return cfg
    name = "ddp" if layout.name in ("ddp", "single") else "fsdp"
    strategy = s.model_copy(update={"name": name, "tp": layout.tp})
    return cfg.model_copy(update={"strategy": strategy})


def _example(pipe: Any, cfg: Any) -> Any:
    """One micro-batch as a rank reads it (under pp, a pipeline micro-batch's rows): of a file
    stream (raylane.hf's), its first rows as its transform makes them (packed token rows); None for
    another stream, or files too short for one batch."""
    from raylane.loop.data.loader import first_batch
    from raylane.loop.data.streaming import FileEvalStream, FileSource

    s = cfg.strategy
    rows = cfg.train.batch_size // s.microbatches if s.pp > 1 else cfg.train.batch_size
    try:
        if isinstance(pipe.train_set, FileSource):  # rank 0's first batch of the files: a stream, read in order
            batch = next(iter(FileEvalStream(pipe.train_set, batch_size=max(rows, 1), rank=0, world_size=1)), None)
            return batch if batch is not None and _rows_of(batch) == max(rows, 1) else None  # never a short batch
        return first_batch(pipe.train_set, max(rows, 1), pipe.collate_fn)
    except Exception:  # noqa: BLE001 - data the meta build could not read here: activations unmeasured
        return None


def _rows_of(batch: Any) -> int:
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0] if isinstance(batch, tuple) else batch
    return len(first)


def _describe(out: Rehearsal, pipe: Any, cfg: Any, target: Target, layout: Any) -> None:
    from raylane import pipelines_ref

    gpu = f"{size_text(target.memory_bytes)}"
    peak = target.peak_flops(cfg.train.precision)
    gpu += f", {peak / 1e12:,.0f} TFLOP/s {cfg.train.precision}" if peak else f", no {cfg.train.precision} peak known"
    n = sum(p.numel() for p in pipe.model.parameters())
    count = f"{n / 1e9:,.2f}B" if n >= 1e8 else f"{n:,}"
    out.lines += [
        f"rehearsal of the {pipelines_ref.label(cfg.pipeline)} pipeline at {target.text()} ({gpu} each), "
        f"{len(out.shares)} rank{'s' if len(out.shares) > 1 else ''} laid out on torch's fake process group in this process",
        f"model: {type(pipe.model).__name__}, {count} parameters ({size_text(figures.model_bytes(pipe.model))})",
        f"layout: {layout.label()} ({layout.mesh_text() or f'{layout.data_parallel} data-parallel ranks'}): "
        f"{mesh_line(layout, target)}",
    ]
    if first_reason := out.shares[0].reason:
        out.lines.append(f"  why: {first_reason}")


def _weigh(out: Rehearsal, pipe: Any, cfg: Any, target: Target, layout: Any, example: Any) -> None:
    """Each played rank's memory against the GPU's; ConfigError for a rank over it, a warning
    past the usable share."""
    from raylane.loop.distributed.blocks import blocks_of

    blocks = blocks_of(pipe.model, pipe.blocks)
    largest = max((figures.local_bytes(b.parameters()) for b in blocks), default=0)
    acts = figures.activations(pipe, cfg, target, layout, example)
    o = cfg.optim
    out.lines.append(
        f"per rank ({o.name}; gradients and optimizer state in the parameters' dtype, FSDP's blocks gathered in "
        f"{cfg.train.precision}; activations of one micro-batch of {_rows(cfg)} rows"
        + (", measured with the tp plan laid out)" if layout.tp > 1 else ")")
    )
    device = target.memory_bytes
    firsts = {tuple(sh.stages): sh for sh in reversed(out.shares)}  # each stage's first shard
    for share in out.shares:
        held = len(blocks) if not share.stages else _blocks_held(len(blocks), layout, cfg, share)
        mine = None if acts is None else figures.stage_activations(acts, share, layout, cfg, len(blocks), held)
        padded = firsts[tuple(share.stages)]
        out.memory[share.rank] = mem = figures.memory(share, cfg, largest, mine, padded)
        stage = f" (stage {', '.join(map(str, share.stages))})" if share.stages else ""
        out.lines.append(f"  rank {share.rank}{stage}: {mem.text(device)}")
    worst = max(out.shares, key=lambda sh: out.memory[sh.rank].total)
    need = out.memory[worst.rank].total
    if need > device:
        raise ConfigError(
            f"--gpu {target.gpu}: rank {worst.rank} would need ~{size_text(need)} of its {size_text(device)} under "
            f"{layout.label()} at {target.flags()} ({out.memory[worst.rank].text(device).split(': ', 1)[1]}); "
            "shard further (strategy.tp, strategy.pp, fewer replicas: strategy.dp_replicate) or set "
            "train.activation_checkpointing: true"
        )
    if need > USABLE * device:
        out.warnings.append(
            f"rank {worst.rank} would fill {need / device:.0%} of the {target.gpu}'s memory, past the {USABLE:.0%} "
            "raylane plans for (the allocator's fragmentation, the CUDA context)"
        )
    if short := figures.short_rows(pipe.model, layout.dp_shard, layout.tp):
        out.warnings.append(
            f"uneven shards: FSDP2 splits a parameter over {layout.dp_shard} shards, and {', '.join(short[:4])}"
            f"{' ...' if len(short) > 4 else ''} have fewer rows in every dimension: the ranks past them hold padding (memory, "
            "no work), and each gather moves it"
        )
    if acts is None:
        out.warnings.append("activations not measured (no example batch, or a forward the meta device cannot run)")


def _rows(cfg: Any) -> int:
    s = cfg.strategy
    return cfg.train.batch_size // s.microbatches if s.pp > 1 else cfg.train.batch_size


def _blocks_held(n_blocks: int, layout: Any, cfg: Any, share: Share) -> int:
    stages = layout.pp * cfg.strategy.stages_per_rank
    return round(n_blocks * len(share.stages) / stages)


def _batch_and_step(out: Rehearsal, pipe: Any, cfg: Any, target: Target, layout: Any) -> None:
    t, dp = cfg.train, layout.data_parallel
    samples = t.batch_size * t.grad_accum_steps * dp
    tokens = samples * pipe.tokens_per_sample if pipe.tokens_per_sample else None
    out.lines.append(
        f"batch: {samples:,} samples per step (train.batch_size {t.batch_size} x grad_accum_steps "
        f"{t.grad_accum_steps} x {dp} data-parallel ranks)" + (f", {tokens:,} tokens" if tokens else "")
    )
    _check_data(out, pipe, cfg, samples)
    s = cfg.strategy
    if layout.pp > 1 and s.microbatches < 2 * layout.pp:
        idle = (layout.pp - 1) / (s.microbatches + layout.pp - 1)
        out.warnings.append(
            f"strategy.pp_microbatches = {s.microbatches} with strategy.pp = {layout.pp}: the pipeline's bubble "
            f"idles ~{idle:.0%} of each step (1F1B's (pp-1)/(m+pp-1)); more micro-batches shrink it"
        )
    n = sum(p.numel() for p in pipe.model.parameters())
    per_token = pipe.flops_per_token or 6 * n
    how = "the pipeline's flops_per_token" if pipe.flops_per_token else "6 x parameters per token"
    peak = target.peak_flops(t.precision)
    if not (tokens and peak):
        out.lines.append("step: not estimated (no tokens per sample, or no peak FLOP/s for this precision)")
        return
    seconds = figures.step_seconds(per_token, tokens, target, t.precision)
    out.lines.append(
        f"step: ~{seconds:.2f} s estimated ({per_token * tokens:.2e} FLOPs: {how} x tokens, at {MFU:.0%} MFU of "
        f"{target.world} x {peak / 1e12:,.0f} TFLOP/s; no pipeline bubble, no communication left unoverlapped)"
    )


def _check_data(out: Rehearsal, pipe: Any, cfg: Any, samples: int) -> None:
    """The training data against one step's samples at N: a global batch larger than the data is
    refused on every rank (GlobalOrderSampler: an epoch of no step); without one, the sampler pads
    each rank's share with repeats (DistributedSampler), which is a warning."""
    try:
        n = len(pipe.train_set)
    except TypeError:  # a stream: its length is the run's to find
        return
    if n >= samples:
        return
    if cfg.train.global_batch is not None:
        raise ConfigError(
            f"train.global_batch = {cfg.train.global_batch}: more than the {n:,} training samples at "
            f"--world {cfg.scaling.num_workers}; an epoch would have no step"
        )
    out.warnings.append(
        f"the {n:,} training samples fill less than one step of {samples:,} at --world "
        f"{cfg.scaling.num_workers}: every epoch is one step, its samples repeated to give each rank its batch"
    )


def _records(out: Rehearsal, pipe: Any, cfg: Any, target: Target, layout: Any) -> None:
    """A checkpoint's files and bytes per save, and MLflow's entries per logging window at N
    against 2 ranks (a warning where they grow with the ranks)."""
    from raylane.loop.distributed.parallelize import OPTIMIZER_STATES
    from raylane.loop.steps import Throughput

    o, t = cfg.optim, cfg.train
    states = OPTIMIZER_STATES.get(o.name, 1 if o.momentum else 0)
    trainable = figures.local_bytes(p for p in pipe.model.parameters() if p.requires_grad)
    saved = figures.model_bytes(pipe.model) + states * trainable
    files, how = figures.checkpoint_files(layout, target.world)
    out.lines.append(f"checkpoint: {files:,} files per save ({how}), ~{size_text(saved)} per save")
    samples = t.batch_size * t.grad_accum_steps * layout.data_parallel
    throughput = Throughput(pipe.tokens_per_sample, pipe.flops_per_token, target.peak_flops(t.precision))
    nodes = [f"node{r // target.per_node}" for r in range(target.world)]
    at_n = figures.window_entries(target.world, nodes, throughput, samples)
    at_2 = figures.window_entries(2, nodes[:2], throughput, samples)
    if not cfg.stragglers.enabled:  # no step times gathered, no steps/*
        at_n.pop("steps/*"), at_2.pop("steps/*")
    counts = ", ".join(f"{k} {v}" for k, v in at_n.items())
    same = "the same at 2 ranks: none per rank" if at_n == at_2 else f"{sum(at_2.values())} at 2 ranks"
    line = f"mlflow: {sum(at_n.values())} metrics per logging window of {cfg.mlflow.log_every_n_steps} steps ({counts}; {same})"
    if cfg.mlflow.system_metrics:
        every = f"every {cfg.mlflow.system_metrics_interval_s:g} s"
        if target.nodes <= NODE_SERIES:
            line += f"; apart from windows, system/<node>/* from each of the {target.nodes} nodes {every}"
        else:
            line += f"; apart from windows, system/nodes/* over the {target.nodes} nodes (min, median, max) {every}"
    out.lines.append(line)
    if at_n != at_2:
        out.warnings.append(f"MLflow's metrics per window grow with the ranks: {at_2} at 2, {at_n} at {target.world}")
