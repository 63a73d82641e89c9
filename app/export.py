"""`raylane export CHECKPOINT --out model.safetensors`: the whole model's weights in one
safetensors file (no pickle, loadable without Ray or torch.distributed), its config beside it.
A tensor the model holds under two names (a tied weight, a submodule registered twice) is
written once, under its canonical name, as the checkpoint holds it (safetensors refuses shared
tensors); the config and the file's metadata list the other names (`aliases`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from raylane import pipelines_ref
from raylane.config import validate
from raylane.loop import checkpoint
from raylane.loop.aliases import aliases, with_aliases, without_aliases
from raylane.loop.pipeline import example_batch


def _consolidated(checkpoint_dir: str | Path) -> tuple[Any, Any, dict[str, Any]]:
    """(pipeline, its model with the checkpoint's full weights, train state), in one process.
    The weights hold each tensor once (canonical names); the model has every name back."""
    problem = checkpoint.verify(str(checkpoint_dir))
    if problem:
        raise ValueError(f"{checkpoint_dir}: not a valid checkpoint ({problem})")
    train_state = checkpoint.read_manifest(checkpoint_dir)["train_state"]
    cfg = validate(train_state["config"])
    pipe = pipelines_ref.build(cfg)
    names = aliases(pipe.model)
    whole = Path(checkpoint_dir) / checkpoint.STATE_FILE
    if whole.exists():  # a replicated state, in one file
        state = torch.load(whole, map_location="cpu", weights_only=True)
    else:
        state = {"model": without_aliases(pipe.model.state_dict(), names)}
        # no_dist: a local read of every rank's shard, even where a process group exists (the
        # torchrun driver is rank 0): as a collective it would wait for ranks that are not loading.
        dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
    weights = without_aliases(state["model"], names)  # an earlier version saved the aliases too
    pipe.model.load_state_dict(with_aliases(weights, names))
    return pipe, weights, train_state


def load_model(checkpoint_dir: str | Path) -> tuple[Any, Any]:
    """(the trained model, an example input batch) from a checkpoint."""
    pipe, _, _ = _consolidated(checkpoint_dir)
    return pipe.model, example_batch(pipe)


def export(checkpoint_dir: str | Path, out: str | Path) -> Path:
    """Consolidate a (possibly sharded) checkpoint; returns the config file written beside `out`."""
    pipe, weights, train_state = _consolidated(checkpoint_dir)
    cfg = validate(train_state["config"])
    tensors = {k: v.contiguous() for k, v in weights.items()}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    names = aliases(pipe.model)
    listed = {"aliases": json.dumps(names, sort_keys=True)} if names else {}
    save_file(tensors, str(out), metadata={"pipeline": cfg.pipeline, "step": str(train_state["step"]), **listed})
    config_path = out.with_suffix(".config.json")
    config_path.write_text(json.dumps({"config": train_state["config"], "step": train_state["step"],
                                       "raylane_version": train_state.get("raylane_version"),
                                       # alias -> the name it is stored under in the weights
                                       **({"aliases": names} if names else {})}, indent=2))
    return config_path
