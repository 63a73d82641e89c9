"""What a pipeline hands to the trainer: built outside it, passed in (the tutorial's shape)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

# A pipeline's `step` (raylane.StepFn): step(model, batch) -> loss, or (loss, {metric: value}).
StepFn = Callable[[torch.nn.Module, Any], torch.Tensor | tuple[torch.Tensor, dict[str, Any]]]


@dataclass
class Pipeline:
    """The model and data of a run, and what of the loop a pipeline replaces. Only `model` and
    `train_set` are required; docs/pipelines.md has the three forms of a step (a pair and
    `loss_fn`, a batch and the model's own loss, a `step` of the pipeline's own)."""

    model: torch.nn.Module
    train_set: Dataset | Any  # a map-style Dataset, or a raylane.FileSource
    # None, a dataset, or {name: dataset}: named held-out sets, each logged under its own prefix.
    eval_set: Dataset | dict[str, Any] | Any | None = None
    # (output, target) for an (input, target) batch; (output, batch) for any other batch. None:
    # the model's own loss (output.loss, output["loss"], or a scalar output).
    loss_fn: Callable[..., torch.Tensor] | None = None
    # (output, target or batch) -> {metric: sum over the batch}; divided by the sample count (or
    # eval_count's units) after the all-reduce, so every metric is exact whatever the world size.
    # None: the loss, averaged exactly over the held-out samples.
    eval_sums: Callable[..., dict[str, torch.Tensor]] | None = None
    example_input: Any = None
    # Language models: tokens in one sample, and model FLOPs per token (forward and backward),
    # for tokens_per_s and MFU.
    tokens_per_sample: int | None = None
    flops_per_token: float | None = None
    # Rows that hold padding (packed or padded sequences): batch -> the batch's tokens that are
    # data (an int, or a CPU tensor of one; None for a batch without padding), read before each
    # forward, for real_tokens_per_s, padding_share and the summary's packing efficiency.
    real_tokens: Callable[[Any], Any] | None = None
    # step(model, batch) -> loss, or (loss, {metric: value}): the whole forward and loss, for
    # what loss_fn cannot express (several outputs, a frozen teacher, a contrastive pair).
    step: StepFn | None = None
    # The units a held-out batch's metrics are averaged over (tokens, say): batch -> int or tensor.
    # None: samples.
    eval_count: Callable[[Any], Any] | None = None
    # Turns a list of dataset items into a batch (variable-length items, padding).
    collate_fn: Callable[[list[Any]], Any] | None = None
    # optimizer(model, cfg) -> torch.optim.Optimizer, and scheduler(optimizer, cfg, total_steps)
    # -> an LRScheduler or None, in place of raylane's (cfg.optim).
    optimizer: Callable[..., Any] | None = None
    scheduler: Callable[..., Any] | None = None
    # Callbacks at step ends, evaluation ends and checkpoints (raylane.loop.protocols.hooks).
    hooks: Sequence[Any] = ()
    # The model's repeated layers, the unit of FSDP sharding, activation checkpointing and
    # compile: a list or ModuleList of its modules. None: found (raylane.loop.distributed.parallelize).
    blocks: Any = None
    # init_weights(model): fills the weights of a model built on the meta device (shapes, no
    # memory), on every rank once it is parallelized and given storage: raylane.hf.load_pretrained
    # reads them on rank 0 and broadcasts. Not called when the run resumes from a checkpoint.
    init_weights: Callable[[torch.nn.Module], None] | None = None
    # Which modules tensor parallelism splits (strategy.tp > 1): {module path: torch ParallelStyle},
    # `*` for one name of the path ("blocks.*.attn.q_proj": ColwiseParallel()), or
    # tp_plan(model, sequence_parallel) -> that. None: the pipeline runs without tensor parallelism.
    tp_plan: Mapping[str, Any] | Callable[[torch.nn.Module, bool], Mapping[str, Any]] | None = None
    # How pipeline parallelism (strategy.pp > 1) splits the model into stages: "auto" (its blocks
    # split evenly, what comes before them on the first stage, after them on the last), or a list
    # per stage of the module names it holds (["wte", "wpe", "blocks.0"], ["blocks.1", "ln_f",
    # "lm_head"]). Names stay the model's (checkpoints load at any layout). Or a
    # raylane.loop.distributed.pipeline_parallel.Stages, for a model whose forward needs help to run as a stage
    # (raylane.hf's causal LMs). None: no pipeline.
    pp_stages: str | Sequence[Sequence[str]] | Any | None = None
    # Which modules are the model's experts, split over ranks by expert parallelism (strategy.ep
    # > 1): module paths, `*` for one name of the path ("layers.*.moe.experts"), or ep_plan(model)
    # -> those. Each experts module holds every expert's weights in its own parameters, the experts
    # leading ([experts, ...]), and its forward is experts(hidden [T, H], top_k_index [T, k],
    # top_k_weights [T, k]) -> [T, H] (transformers 5's fused experts); the router runs as it is.
    # None: the pipeline runs without expert parallelism.
    ep_plan: Sequence[str] | Callable[[torch.nn.Module], Sequence[str]] | None = None


# Keys of a dict batch that hold targets, not the model's inputs: left out of a dict example.
LABEL_KEYS = ("labels", "label")


def example_batch(pipe: Pipeline, rows: int = 2) -> Any:
    """The pipeline's `example_input`, or else the model's inputs in the first `rows` items of its
    eval set (or its train set), collated as the loader does: what an MLflow model's signature and
    input example are made from. An (input, target) pair gives its input; a dict batch its tensors
    but the labels; a tensor or a tuple of tensors itself. ValueError when neither set gives one
    (a streaming set, inputs that are not tensors)."""
    from torch.utils.data import default_collate

    if pipe.example_input is not None:
        return pipe.example_input
    if pipe.step is not None:  # the step alone knows which of a batch's items the model takes
        raise ValueError(
            "the pipeline gives a step and no example_input: give build(cfg)'s Pipeline an "
            f"example_input (the model's inputs for a batch of {rows} rows or more)"
        )
    for data in (pipe.eval_set, pipe.train_set):
        try:
            items = [data[i] for i in range(rows)]
            batch = (pipe.collate_fn or default_collate)(items)
        except Exception:  # noqa: BLE001, S112 - None, iterable-only, too short, items of several shapes
            continue
        if (inputs := _model_inputs(batch)) is not None:
            return inputs
    raise ValueError(
        "the pipeline sets no example_input, and its datasets' first inputs are not tensors of one "
        f"shape: give build(cfg)'s Pipeline an example_input (a batch of {rows} rows or more)"
    )


def _model_inputs(batch: Any) -> Any:
    from collections.abc import Mapping

    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        return batch[0]
    if isinstance(batch, Mapping):
        from raylane.loop.protocols.batches import TALLY

        inputs = {
            k: v
            for k, v in batch.items()
            if k not in LABEL_KEYS and isinstance(v, torch.Tensor) and not str(k).startswith(TALLY)
        }
        return inputs or None
    if isinstance(batch, (tuple, list)) and batch and all(isinstance(x, torch.Tensor) for x in batch):
        return tuple(batch)
    return None
