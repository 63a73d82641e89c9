"""`raylane export CHECKPOINT --out model.safetensors`: the whole model's weights in one
safetensors file (no pickle, loadable without Ray or torch.distributed), its config beside it.
A checkpoint of any layout (one process, DDP, FSDP, tensor or pipeline parallel, at any world
size) is consolidated in one process: its tensors are keyed by the whole model's names, whole
or sharded, and read whole from every rank's files.
A tensor the model holds under two names (a tied weight, a submodule registered twice) is
written once, under its canonical name, as the checkpoint holds it (safetensors refuses shared
tensors); the config and the file's metadata list the other names (`aliases`)."""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from raylane.config import validate
from raylane.loop import checkpoint, usercode
from raylane.loop.checkpoint.aliases import aliases, unexplained, with_aliases, without_aliases
from raylane.loop.checkpoint.frozen import base_of, frozen_names, mismatch, saved_part
from raylane.loop.protocols.pipeline import example_batch

# True while `consolidated` builds a checkpoint's model: in one process, whatever process group
# the caller is in. Under torchrun the driver is rank 0, still in the group at the end of a run
# whose peers have left: a collective there (a pipeline's init_weights broadcasting the base
# weights) fails with "Connection closed by peer" or waits for ranks that are gone.
_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("raylane_export_alone", default=False)


def alone() -> bool:
    """Whether this code runs in the one-process build of a checkpoint's model (`raylane export`,
    the MLflow model at a run's end): a pipeline's `init_weights` must then start no collective,
    though a process group may exist (raylane.hf.load_pretrained reads the weights itself)."""
    return _ALONE.get()


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def consolidated(checkpoint_dir: str | Path) -> tuple[Any, Any, dict[str, Any]]:
    """(pipeline, its model with the checkpoint's full weights, train state), in one process.
    The weights hold each tensor once (canonical names); the model has every name back. A
    checkpoint of a model on a frozen base (LoRA) holds what trained: the rest is the base the
    pipeline loaded, which must be the one the checkpoint records (raylane.loop.checkpoint.frozen). No
    collective runs, even in a process of a group (`alone`)."""
    with _one_process():
        return _consolidated(checkpoint_dir)


def _consolidated(checkpoint_dir: str | Path) -> tuple[Any, Any, dict[str, Any]]:
    problem = checkpoint.verify(str(checkpoint_dir))
    if problem:
        raise ValueError(f"{checkpoint_dir}: not a valid checkpoint ({problem})")
    manifest = checkpoint.read_manifest(checkpoint_dir)
    train_state = manifest["train_state"]
    cfg = validate(one_process(train_state["config"]))
    pipe = usercode.build_pipeline(cfg)
    _give_memory(pipe)
    names = aliases(pipe.model)
    if problem := mismatch(checkpoint_dir, manifest, pipe.model):
        raise ValueError(problem)
    whole = Path(checkpoint_dir) / checkpoint.STATE_FILE
    if whole.exists():  # a replicated state, in one file
        state = torch.load(whole, map_location="cpu", weights_only=True)
    else:
        state = {"model": saved_part(pipe.model, without_aliases(pipe.model.state_dict(), names))}
        # no_dist: a local read of every rank's shard, even where a process group exists (the
        # torchrun driver is rank 0): as a collective it would wait for ranks that are not loading.
        dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
    weights = without_aliases(state["model"], names)  # an earlier version saved the aliases too
    if base_of(pipe.model) is None:
        pipe.model.load_state_dict(with_aliases(weights, names))
        return pipe, weights, train_state
    missing = pipe.model.load_state_dict(with_aliases(weights, names), strict=False).missing_keys
    if not_frozen := sorted(set(unexplained(missing, names)) - frozen_names(pipe.model)):
        raise ValueError(f"{checkpoint_dir}: {not_frozen[0]} trains in this model and is not in the checkpoint")
    return pipe, weights, train_state


def one_process(config: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's config (resolved, as its manifest holds it) as one process builds its
    model: the layout it trained at does not change the model or its names, and what a layout
    needs (a world it splits, a GPU for context parallelism) is no export's business."""
    alone = {"tp": 1, "pp": 1, "cp": 1, "dp_replicate": 1, "sequence_parallel": False, "loss_parallel": False}
    strategy = dict(config.get("strategy") or {})
    strategy.update({k: v for k, v in alone.items() if k in strategy})
    return {**config, "strategy": strategy}


def _give_memory(pipe: Any) -> None:
    """A model built on the meta device (the hf pipeline's) gets memory here, in this process; a
    model on a frozen base gets its base weights from the pipeline (read from its files: the
    checkpoint holds what trained), any other's come whole from the checkpoint."""
    from raylane.loop.distributed.fsdp import materialize, on_meta

    if not on_meta(pipe.model):
        return
    materialize(pipe.model, torch.device("cpu"))
    if base_of(pipe.model) is not None and pipe.init_weights is not None:
        pipe.init_weights(pipe.model)


def load_model(checkpoint_dir: str | Path) -> tuple[Any, Any]:
    """(the trained model, an example input batch) from a checkpoint."""
    pipe, _, _ = consolidated(checkpoint_dir)
    return pipe.model, example_batch(pipe)


def export(checkpoint_dir: str | Path, out: str | Path) -> Path:
    """Consolidate a (possibly sharded) checkpoint; returns the config file written beside `out`."""
    pipe, weights, train_state = consolidated(checkpoint_dir)
    cfg = validate(one_process(train_state["config"]))
    tensors = {k: v.contiguous() for k, v in weights.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = aliases(pipe.model)
    listed = {"aliases": json.dumps(names, sort_keys=True)} if names else {}
    save_file(tensors, str(out), metadata={"pipeline": cfg.pipeline, "step": str(train_state["step"]), **listed})
    config_path = out.with_suffix(".config.json")
    config_path.write_text(
        json.dumps(
            {
                "config": train_state["config"],
                "step": train_state["step"],
                "raylane_version": train_state.get("raylane_version"),
                # alias -> the name it is stored under in the weights
                **({"aliases": names} if names else {}),
            },
            indent=2,
        )
    )
    return config_path


def servable(model: torch.nn.Module, example: Any) -> tuple[torch.nn.Module, tuple[Any, ...], list[str] | None]:
    """(a module that takes the example's tensors positionally and returns one tensor, those
    tensors, their names or None): what MLflow's PyTorch flavour logs (torch.export, one output
    tensor). A tensor example and a model returning a tensor are the model itself. A dict example
    (a dict batch's inputs) is passed to the model as keywords, in the example's key order; a
    tuple, positionally; an output that is a dict or has fields (a Hugging Face ModelOutput)
    gives its first tensor that is not the loss (the logits)."""
    with torch.no_grad():
        if isinstance(example, torch.Tensor):
            if isinstance(model(example), torch.Tensor):
                return model, (example,), None
            return _adapter(model, None, 1), (example,), None
        if isinstance(example, Mapping):
            names = [str(k) for k in example]
            return _adapter(model, names, len(names)), tuple(example.values()), names
        if isinstance(example, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in example):
            return _adapter(model, None, len(example)), tuple(example), None
    raise ValueError(
        f"the example input is {type(example).__name__}: a tensor, a dict or a tuple of tensors "
        "is what an MLflow model can take"
    )


class _Served(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, names: list[str] | None) -> None:
        super().__init__()
        self.model, self.names = model, names

    def _call(self, *inputs: torch.Tensor) -> torch.Tensor:
        output = self.model(**dict(zip(self.names, inputs, strict=True))) if self.names else self.model(*inputs)
        return _first_tensor(output)


def _first_tensor(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        values = [v for k, v in output.items() if k != "loss"]
    elif isinstance(output, (tuple, list)):
        values = list(output)
    else:
        values = [v for k, v in vars(output).items() if k != "loss"]
    found = next((v for v in values if isinstance(v, torch.Tensor)), None)
    if found is None:
        raise ValueError(f"the model's output ({type(output).__name__}) holds no tensor besides the loss")
    return found


def _adapter(model: torch.nn.Module, names: list[str] | None, count: int) -> torch.nn.Module:
    """A _Served whose forward has one named parameter per input: torch.export binds inputs by
    forward's signature, and a *args forward reads as one input."""
    params = [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for n in ["self", *(names or [f"input_{i}" for i in range(count)])]
    ]

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._call(*inputs)

    forward.__signature__ = inspect.Signature(params)
    return type("ServedModel", (_Served,), {"forward": forward})(model, names)
