"""Whether one GPU takes two NCCL ranks: issue 62's kill on GPUs needs one GPU per replica group
unless it does. Two processes each open cuda:0, join one NCCL group (a TCP store on loopback) and
all-reduce a tensor, bounded by a timeout; prints one line with the outcome (and NCCL's reason).

    python scripts/gpu_nccl_two_ranks.py          # on a machine with one GPU or more
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, port: int, results) -> None:
    try:
        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
        dist.init_process_group(
            "nccl", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30),
            device_id=torch.device("cuda", 0),
        )  # fmt: skip
        x = torch.full((4,), float(rank + 1), device="cuda:0")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        results.put((rank, "ok", float(x[0])))
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the outcome is what this script reports
        results.put((rank, "failed", " ".join(f"{type(exc).__name__}: {exc}".split())[:400]))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU here")
        return 2
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        if p.is_alive():
            p.kill()
    got = []
    while not results.empty():
        got.append(results.get())
    ok = len(got) == 2 and all(status == "ok" and value == 3.0 for _, status, value in got)
    print(f"NCCL, two ranks on one GPU ({torch.cuda.get_device_name(0)}, NCCL {torch.cuda.nccl.version()}):",
          "all-reduce correct" if ok else f"refused: {sorted(got)}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
