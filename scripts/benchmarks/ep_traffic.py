"""B17's probe, one per rank under torchrun: a real `raylane train` whose optimizer steps
(`Trainer.run_step`) run under a dispatch mode that sees every c10d collective issued, writing
OUT/rank<r>.json with
- `params`: this rank's parameter bytes after the layout (its own shards: `DTensor.to_local()`),
  the experts (parameters of a module named `experts`) and the rest;
- `steps`: per optimizer step, for each kind of collective, how many were issued and the bytes
  this rank sent to other ranks (ring algorithms: an all-gather sends (W-1)/W of the gathered
  tensor, a reduce-scatter (W-1)/W of its input, an all-reduce twice that; an all-to-all its
  input less the rows it keeps; W the size of the op's group). DTensor's functional collectives
  are counted too (`functional all_reduce`: a sharded model's gradient norm).

Instrumentation only: the training code runs unchanged (the counting costs time, so B17 times
its steps in runs without it).

    torchrun --nproc_per_node 2 -m scripts.benchmarks.ep_traffic OUT -- train CONFIG --set ..."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

import raylane.loop.trainer
from raylane.cli import main


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def sent_bytes(op: str, args: tuple[Any, ...]) -> int:
    """What this rank sends to others for one c10d op, from the ops' schemas (torch/csrc/
    distributed/c10d/Ops.cpp: the tensors, then the group, boxed as a torch.classes.c10d.ProcessGroup); 0 for ops it does not price (barrier, send, recv)."""
    boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
    group = dist.ProcessGroup.unbox(boxed) if boxed is not None else None
    w, rank = (group.size(), group.rank()) if group is not None else (1, 0)
    share = (w - 1) / w
    if op in ("_allgather_base_", "_reduce_scatter_base_"):  # (output, input, group, ...)
        whole = args[0] if op == "_allgather_base_" else args[1]
        return int(share * _bytes(whole))
    if op in ("allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_"):  # ([outputs], [inputs], ...)
        whole = args[0] if op.startswith("allgather") else args[1]
        return int(share * sum(map(_bytes, whole)))
    if op == "allreduce_":  # ([tensors], group, ...)
        return int(2 * share * sum(map(_bytes, args[0])))
    if op == "alltoall_base_":  # (output, input, group, output_splits, input_splits, ...)
        inp, sends = args[1], list(args[4])
        if not sends:  # even splits
            return int(share * _bytes(inp))
        row = _bytes(inp) // max(inp.shape[0], 1)
        return _bytes(inp) - sends[rank] * row
    if op == "broadcast_":  # ([tensors], group, root, ...): the root sends to every other rank
        return (w - 1) * sum(map(_bytes, args[0])) if rank == args[2] else 0
    return 0


class Collectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: dict[str, int] = defaultdict(int)
        self.sent: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            op = name.removeprefix("c10d.").split(".")[0]
            self.count[op] += 1
            self.sent[op] += sent_bytes(op, tuple(args))
        elif name.startswith("_c10d_functional.") and not name.startswith("_c10d_functional.wait"):
            # DTensor's own collectives (the gradient norm's all-reduce over a sharded model):
            # counted; an all-reduce's bytes priced, its group named by a string.
            op = "functional " + name.removeprefix("_c10d_functional.").split(".")[0]
            self.count[op] += 1
            if op == "functional all_reduce":
                w = _resolve_process_group(args[2]).size()
                self.sent[op] += int(2 * (w - 1) / w * _bytes(args[0]))
        return func(*args, **(kwargs or {}))


def local_params(model: torch.nn.Module) -> dict[str, int]:
    sizes = {"experts": 0, "rest": 0}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        sizes["experts" if ".experts." in name else "rest"] += _bytes(local)
    return sizes


def run(out: Path, argv: list[str]) -> int:
    record: dict[str, Any] = {"params": None, "steps": []}
    original = raylane.loop.trainer.Trainer.run_step

    def counted(self, micro_batches):
        if record["params"] is None:
            record["params"] = local_params(self.model)
        with Collectives() as seen:
            loss = original(self, micro_batches)
        record["steps"].append({"count": dict(seen.count), "sent": dict(seen.sent)})
        return loss

    raylane.loop.trainer.Trainer.run_step = counted
    code = main(argv)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
    return code


if __name__ == "__main__":
    where, sep, *rest = sys.argv[1:]
    assert sep == "--", "usage: ep_traffic OUT -- train CONFIG ..."
    code = run(Path(where), rest)
    # As `python -m raylane` does on torchrun ranks: no interpreter teardown, where gloo's threads
    # can abort the process after the run is done (see app/raylane/__main__.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
