"""A rank's random generators (torch, numpy, python) as a checkpoint holds them: plain JSON, so
that a resume at the same world size draws the same numbers as the run it continues, and a load
unpickles nothing. A sharded checkpoint holds one `rng_<rank>.json` per rank; a replicated one
carries every rank's inside rank 0's `state.pt` (raylane.loop.checkpoint.writing)."""

from __future__ import annotations

import base64
import random
from typing import Any, cast

import numpy as np
import torch


def rng_file(rank: int) -> str:
    return f"rng_{rank}.json"


def rng_state() -> dict[str, Any]:
    """This rank's random generators (torch, numpy, python) as plain JSON: nothing to unpickle."""
    # The legacy tuple (numpy's default at run time), which numpy's stubs type as a dict.
    legacy = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = legacy
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_kind, np_keys.tolist(), np_pos, np_has_gauss, np_gauss],
        "python": [py_version, list(py_state), py_gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))
