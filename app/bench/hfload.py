"""B12's measured program, one per rank under torchrun: load a `save_pretrained` causal LM the
way MODE says, then write OUT/rank<r>.json with the peak resident set while loading (the peak is
reset after the imports, so it is the load's) and the resident set before it.

- `raylane`: built on the meta device, sharded by raylane's FSDP2 (per decoder layer), given
  memory, and filled by raylane.hf.load_pretrained (rank 0 reads the files, the rest receive
  their shards by broadcast): what every raylane run of the `hf` pipeline does.
- `from_pretrained`: every rank calls AutoModelForCausalLM.from_pretrained, as a script would.

    torchrun --nproc_per_node 2 -m raylane.bench.hfload MODE MODEL_DIR OUT"""

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


def main() -> None:
    mode, path, out = sys.argv[1:4]
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401 - imported before the peak is reset, as on both sides

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    if mode == "raylane":
        import raylane.hf
        from raylane.hf.weights import empty_model, load_pretrained
        from raylane.loop.parallel import parallelize

        cfg = raylane.hf.Config(model={"name_or_path": path}, strategy={"name": "fsdp"})
        model, _ = parallelize(empty_model(path), cfg, torch.device("cpu"), dist.get_world_size())
        load_pretrained(model, path)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path)
    dist.barrier()
    peak = _status("VmHWM")
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"before_bytes": before, "peak_bytes": peak,
                                                            "load_bytes": peak - before}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
