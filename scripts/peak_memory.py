"""Runs a Python module or script and, when it exits, writes its process's peak memory to
OUT/rank<RANK>.json: the peak resident set (ru_maxrss, bytes) and, where CUDA was used, the peak
CUDA memory allocated. The same measure for every side of a benchmark (B11: raylane and the HF
Trainer, each rank under torchrun):

    torchrun --nproc_per_node 2 scripts/peak_memory.py OUT -m raylane train cfg.yaml
    torchrun --nproc_per_node 2 scripts/peak_memory.py OUT scripts/hf_trainer_baseline.py ..."""

from __future__ import annotations

import atexit
import json
import os
import resource
import runpy
import sys


def _write(out: str) -> None:
    peak = {"rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
    with open(os.path.join(out, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(peak, f)


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    os.makedirs(out, exist_ok=True)
    atexit.register(_write, out)  # raylane's CLI runs the exit functions before its os._exit
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
