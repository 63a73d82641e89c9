"""How a worker joins its replica group (`fault_tolerance:`; raylane.loop.distributed.ft is the
group's steps): torchft's Manager, with its store, its process group across groups and raylane's
own heal transport, and the replicas object the Trainer asks at each step: `ReplicaGroups`, or
`SemiSync` under `fault_tolerance.semi_sync`. Its own module so that the steps' modules import
nothing of the choice between them. torchft is imported only when a run has replica groups."""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch

from raylane.loop.distributed.ft import OneReplica, ReplicaGroups, replica_group
from raylane.loop.distributed.ft_semisync import SemiSync


def replicas_for(cfg: Any, runtime: Any, model: torch.nn.Module, optimizer: Any, reporter: Any) -> OneReplica:
    """This worker's replicas: its group's `ReplicaGroups` (`SemiSync` under semi_sync) over `model`
    (parallelized) and its `optimizer`, with torchft's Manager joined to the lighthouse;
    `OneReplica` without groups."""
    group = replica_group()
    if group is None:
        return OneReplica()
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every step at info
    # Its Manager warns at every quorum that NCCL's flight recorder has no reset (torch 2.13); its
    # errors still show.
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)
    from torchft.manager import Manager

    from raylane.loop.distributed.ft_transport import BoundTransport, serving_host

    ft = cfg.fault_tolerance
    host, store = _manager_store(runtime)
    timeout = datetime.timedelta(seconds=ft.timeout_s)
    manager = Manager(
        pg=_process_group(ft.pg_backend(cfg.scaling.use_gpu), ft.timeout_s),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=ft.min_replicas,
        use_async_quorum=ft.semi_sync.method == "none",
        timeout=timeout,
        quorum_timeout=datetime.timedelta(seconds=ft.quorum_timeout_s),
        connect_timeout=datetime.timedelta(seconds=ft.connect_timeout_s),
        rank=runtime.rank,
        world_size=runtime.world_size,
        store_addr=host,
        store_port=store[1],
        lighthouse_addr=group.lighthouse or None,
        replica_id=f"{cfg.run.name}-g{group.index}",
        # The state a healing group copies: served on this node's address, loaded as tensors only.
        checkpoint_transport=BoundTransport(serving_host(host), timeout),
    )
    kw = {"store": store[0], "seed": cfg.train.seed, "reporter": reporter, "rank": runtime.rank}
    kw["start_wait_s"] = ft.quorum_timeout_s  # the start barrier's bound (ReplicaGroups._await_the_others)
    if ft.semi_sync.method != "none":  # the groups meet every sync_steps steps, not every step
        return SemiSync(manager, group, model, optimizer, semi_sync=ft.semi_sync, **kw)
    return ReplicaGroups(manager, group, model, optimizer, **kw)


def _process_group(backend: str, timeout_s: float) -> Any:
    """torchft's process group across groups, reconfigured at each new quorum."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    kind = ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo
    return kind(timeout=datetime.timedelta(seconds=timeout_s))


def _manager_store(runtime: Any) -> tuple[str, tuple[Any, int]]:
    """(the host, (the TCPStore, or None off rank 0; its port)) of the Manager's store: hosted by
    the group's rank 0 on a free port, the port shared over the group (one broadcast, at start)."""
    import torch.distributed as dist

    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    store, port = None, 0
    if runtime.rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        port = store.port
    if runtime.world_size > 1:
        shared = [port]
        dist.broadcast_object_list(shared, src=0)
        port = int(shared[0])
    return host, (store, port)
