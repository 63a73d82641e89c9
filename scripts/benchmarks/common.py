"""What every benchmark module shares: where the repo is, how runs are started, and the figure
each set of repeats becomes (its own module, so that the harness, which imports every benchmark,
is imported by none of them)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
RAYLANE = [PY, "-m", "raylane"]
# Steady-state training only: no per-epoch evaluation or checkpoint, no tracking (B5 prices it).
QUIET = [
    "mlflow.enabled=false",
    "checkpoint.every_n_steps=0",
    "checkpoint.every_n_epochs=0",
    "train.eval_every_n_epochs=0",
]


def stats(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }
