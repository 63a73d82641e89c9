"""The work on torch's fake process groups that runs in a process before it trains (the forward
check on each torchrun rank, `tp: auto`'s measurement on every rank) leaves that process as it
found it (raylane.loop.distributed.fake.fake_work), in one process: a model laid out afterwards computes on
its own mesh, as its own rank; the measurement gives the same bytes alone and after other work;
no fake group stays registered. Before, DTensor's sharding caches handed the run the check's
mesh (torchrun's rank 1 computed as the fake group's rank 0: tp2+sp+lp's losses off one
process's from step 2) and a later measurement a destroyed group's name. The losses themselves,
under torchrun: tests/e2e/test_fake_work.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from raylane.config import load_config
from raylane.loop.data.loader import first_batch
from raylane.loop.distributed.layout import Layout, loss_context
from raylane.loop.distributed.parallelize import parallelize
from raylane.loop.protocols.batches import forward_loss

TP2 = ("strategy.tp=2", "strategy.sequence_parallel=true", "strategy.loss_parallel=true", "optim.name=sgd")


def _world(rank: int, size: int) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)


def _tp_ranks_seen(cfg) -> set[int]:
    """As rank 1 of a fake world of 2, gpt-tiny laid out by the config, one forward, loss and
    backward: the tensor-parallel rank of every DTensor its ops made."""
    from raylane.pipelines.gpt import build

    pipe = build(cfg)
    batch = first_batch(pipe.train_set, cfg.train.batch_size)
    _world(1, 2)
    try:
        model, _ = parallelize(pipe.model, cfg, torch.device("cpu"), 2, blocks=pipe.blocks, tp_plan=pipe.tp_plan)
        seen = _TpRanks()
        with loss_context(cfg.strategy.loss_parallel), seen:
            loss, _, _ = forward_loss(model, batch, pipe.loss_fn)
            loss.backward()
        return seen.ranks
    finally:
        dist.destroy_process_group()


class _TpRanks(TorchDispatchMode):
    """The tensor-parallel rank, by its mesh, of every DTensor an op makes, backward's too."""

    def __init__(self) -> None:
        super().__init__()
        self.ranks: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            names = t.device_mesh.mesh_dim_names or () if isinstance(t, DTensor) else ()
            if "tp" in names:
                self.ranks.add(t.device_mesh.get_coordinate()[names.index("tp")])
        return out


def test_a_model_laid_out_after_the_forward_check_computes_as_its_own_rank():
    """The forward check (one rank's share of the plan, as rank 0 of its own fake group) and then,
    in the same process, the run as rank 1: every DTensor of its forward and backward is on rank
    1's mesh. Seen failing without fake_work: outputs on the check's mesh, tensor-parallel rank 0,
    {0, 1} (under torchrun, tp2+sp+lp's losses off from step 2)."""
    from raylane.loop.distributed.fake import forget_shardings
    from raylane.loop.distributed.forward_checks import check_model_parallel
    from raylane.pipelines.gpt import build

    forget_shardings()  # DTensor's caches as in a new torchrun rank, whatever ran here before
    cfg = load_config("gpt-tiny", list(TP2))
    check_model_parallel(build(cfg), cfg)  # as the checks before launch run it on every rank
    assert not dist.is_initialized()
    assert _tp_ranks_seen(cfg) == {1}


def test_tp_auto_measures_the_same_alone_and_after_other_work(monkeypatch):
    """`tp: auto`'s per-rank bytes on 8 fake ranks: the same measured after other work in this
    process (parameter bytes measured 12 times over: 24 groups made and gone) as alone in a world
    of its own afterwards. Seen failing without fake_work: the second measurement's activations
    fell back to the whole model's (TP2 ~19.4 MiB, against 11.6 alone; B1's report), its forward
    under the plan finding a group of the world before in DTensor's caches ('Could not resolve
    the process group registered under the name ...')."""
    from raylane.loop.distributed.auto import parameter_bytes
    from raylane.loop.distributed.fake import forget_shardings
    from raylane.pipelines.gpt import build

    def gpt(budget: float = 1000):
        sets = ["model.n_head=8", "model.n_layer=2", "strategy.name=fsdp", "strategy.tp=auto"]
        cfg = load_config("gpt-tiny", [*sets, "strategy.sequence_parallel=true", f"scaling.device_memory_gb={budget}"])
        return cfg, build(cfg)

    def measured() -> dict[str, int]:
        cfg, pipe = gpt()
        example = first_batch(pipe.train_set, cfg.train.batch_size)
        kw = {"example": example, "loss_fn": pipe.loss_fn, "blocks": pipe.blocks, "tp_plan": pipe.tp_plan}
        return parallelize(pipe.model, cfg, torch.device("cpu"), 8, **kw)[1].estimate

    forget_shardings()  # DTensor's caches as in a new process, whatever ran here before
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    _world(0, 8)
    try:
        _, pipe = gpt()
        for _ in range(6):  # other work: meshes made (and, with fake_work, destroyed)
            parameter_bytes(pipe.model, None, Layout("fsdp", dp_shard=8), None)
            parameter_bytes(pipe.model, None, Layout("fsdp", tp=8, sequence_parallel=True), pipe.tp_plan)
        after = measured()
    finally:
        dist.destroy_process_group()
    _world(0, 8)
    try:
        alone = measured()
    finally:
        dist.destroy_process_group()
    assert alone["activations"] > alone["activations_tp2"] > alone["activations_tp4"], alone  # measured
    assert after == alone


def test_fake_work_leaves_no_group_and_puts_dtensor_s_rng_tracker_back():
    """On a real (gloo, one rank) world: the fake groups a measurement makes are destroyed after
    it, the real ones kept; DTensor's RNG tracker (made by a random op on a mesh) is the one from
    before; and the forward check, before any group, leaves none."""
    from torch.distributed.tensor import _random

    from raylane.loop.distributed.fake import fake_mesh, fake_work
    from raylane.loop.distributed.forward_checks import check_model_parallel
    from raylane.pipelines.gpt import build

    tracker = _random._rng_tracker
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        groups = set(dist.distributed_c10d._world.pg_map)
        with fake_work():
            mesh = fake_mesh(Layout("single"))
            made = set(dist.distributed_c10d._world.pg_map) - groups
            assert made and {dist.get_backend(g) for g in made} == {"fake"}, made
            assert mesh["tp"].get_group() in made
            _random._rng_tracker = object()  # as a random op on a mesh of the check's makes one
        assert set(dist.distributed_c10d._world.pg_map) == groups
        assert _random._rng_tracker is tracker
    finally:
        dist.destroy_process_group()
    cfg = load_config("gpt-tiny", list(TP2))
    check_model_parallel(build(cfg), cfg)
    assert not dist.is_initialized() and _random._rng_tracker is tracker
