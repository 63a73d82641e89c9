"""torchft's own semi-sync training, without raylane, as the reference of tests/e2e/test_ft_loop.py:
one replica group of one process, `python ft_semisync_ref.py METHOD GROUP STEPS SYNC_STEPS OUT`
(METHOD: diloco | local_sgd), joined to the lighthouse at $TORCHFT_LIGHTHOUSE. torchft's Manager
(synchronous quorum, both groups needed) with its own DiLoCo or LocalSGD, as its train_diloco.py
uses them, on tests/helpers/ft_pipeline.py's model (built after torch.manual_seed(0), as raylane
seeds every rank) and data: group g reads torch's DistributedSampler shard g of 2 (seed 0,
shuffled), 8 samples a step, in order; inner AdamW(lr 0.01, no weight decay, fused) and, for
DiLoCo, outer SGD(0.7, momentum 0.9, Nesterov). Writes its parameters after the last step to OUT."""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("RUST_LOG", "warn")

ROWS, BATCH, SEED = 2048, 8, 0


def main() -> int:
    import ft_pipeline
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    method, group, steps, sync_steps, out = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5],
    )
    torch.manual_seed(SEED)
    pipe = ft_pipeline.build(SimpleNamespace(model=SimpleNamespace(rows=ROWS, width=16)))
    model, data = pipe.model, pipe.train_set
    inner = torch.optim.AdamW([{"params": list(model.parameters()), "weight_decay": 0.0}], lr=0.01, fused=True)
    order = list(DistributedSampler(range(ROWS), num_replicas=2, rank=group, shuffle=True, seed=SEED))

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": inner.state_dict()}

    def load(s: dict) -> None:
        model.load_state_dict(s["model"])
        inner.load_state_dict(s["optimizer"])

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    minute = datetime.timedelta(seconds=60)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=minute),
        load_state_dict=load,
        state_dict=state,
        min_replica_size=2,
        use_async_quorum=False,
        timeout=minute,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        replica_id=f"ref-g{group}",
    )
    if method == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        algorithm = DiLoCo(manager, [model], inner, outer, sync_every=sync_steps)
    else:
        algorithm = LocalSGD(manager, model, inner, sync_every=sync_steps)
    with algorithm:
        for step in range(1, steps + 1):
            rows = order[(step - 1) * BATCH : step * BATCH]
            x = torch.stack([data[i][0] for i in rows])
            y = torch.stack([data[i][1] for i in rows])
            inner.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            inner.step()
    torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, out)
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
