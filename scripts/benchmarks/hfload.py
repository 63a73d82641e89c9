"""B12's measured program, one per rank under torchrun: load a `save_pretrained` causal LM the
way MODE says, then write OUT/rank<r>.json with the peak resident set while loading (the peak is
reset after the imports, so it is the load's) and the resident set before it.

- `raylane`: built on the meta device, sharded by raylane's FSDP2 (per decoder layer), given
  memory, and filled by raylane.hf.load_pretrained (rank 0 reads the files, the rest receive
  their shards by broadcast): what every raylane run of the `hf` pipeline does.
- `from_pretrained`: every rank calls AutoModelForCausalLM.from_pretrained, as a script would.

Then every weight is written once, as the first optimizer step will (see `_as_training_will`).

    torchrun --nproc_per_node 2 -m scripts.benchmarks.hfload MODE MODEL_DIR OUT"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _as_training_will(model) -> None:
    """Writes every weight once (x 1), as the first optimizer step will. from_pretrained on the
    CPU leaves its tensors mapped from the safetensors file, pages not yet read: its resident set
    right after loading (154 MB for a 276 MB model) says nothing of what training then holds."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for tensor in model.state_dict().values():
            (tensor.to_local() if isinstance(tensor, DTensor) else tensor).mul_(1)


def main() -> None:
    mode, path, out = sys.argv[1:4]
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import raylane.hf
    from raylane.hf.weights import empty_model, load_pretrained
    from raylane.loop.distributed.parallelize import parallelize

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Both sides import everything first (the imports are no part of loading) and the config
    # is checked (it reads the tokenizer); the peak counts from here.
    cfg = raylane.hf.Config(pipeline="hf", model={"name_or_path": path}, strategy={"name": "fsdp"})
    dist.barrier()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    if mode == "raylane":
        model, _ = parallelize(empty_model(path), cfg, torch.device("cpu"), dist.get_world_size())
        load_pretrained(model, path)
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    _as_training_will(model)
    dist.barrier()
    peak = _status("VmHWM")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(
        json.dumps({"before_bytes": before, "peak_bytes": peak, "load_bytes": peak - before})
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
