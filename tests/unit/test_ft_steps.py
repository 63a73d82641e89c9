"""The Trainer's side of replica groups (raylane.loop.distributed.ft), in one process: what a step
that no group commits leaves (nothing: it is taken again, on the same batches), where a heal puts
the loop (its peer's position, across an epoch), how the data splits over groups (DDP's shards),
and, with torchft's real Manager and a lighthouse in this process, that a run of one replica group
is the plain run bit for bit and that checkpoints cross between the two both ways.

The first two drive the Trainer through stand-ins for the replicas object (the interface the
Trainer asks: begin, reduce, commit, healed), which is what they test; the two-group runs with
torchft are tests/e2e/test_ft_loop.py's."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import raylane
from raylane.config import validate
from raylane.loop.distributed import ft
from raylane.loop.run import build_trainer, local_runtime, seed_everything

ROWS = 48  # 6 steps an epoch at batch 8


def _config(root: Path, name: str, **sections: Any) -> raylane.BaseConfig:
    return validate(
        {
            "pipeline": "regression",
            "run": {"name": name, "storage_path": str(root)},
            "train": {"batch_size": 8, "max_epochs": 3, **sections.pop("train", {})},
            # A schedule that moves every step: a step taken twice or skipped shows in the weights.
            "optim": {"name": "adamw", "lr": 0.05, "schedule": "linear", "warmup_steps": 2},
            "checkpoint": {"keep": None, **sections.pop("checkpoint", {})},
            "mlflow": {"enabled": False, "log_every_n_steps": 2},
            **sections,
        }
    )


def _trainer(cfg: raylane.BaseConfig) -> Any:
    seed_everything(cfg.train.seed)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, 4, generator=g)
    pipe = raylane.Pipeline(
        model=torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)),
        train_set=TensorDataset(x, x.sum(dim=1, keepdim=True)),
        loss_fn=torch.nn.functional.mse_loss,
    )
    return build_trainer(cfg, local_runtime(cfg, lambda event: None), pipe)


def _batches_seen(trainer: Any) -> list[torch.Tensor]:
    """The first input of each micro-batch list the Trainer's run_step is given, in order."""
    seen: list[torch.Tensor] = []
    step = trainer.run_step

    def noted(micro_batches: list[Any]) -> Any:
        seen.append(micro_batches[0][0].clone())
        return step(micro_batches)

    trainer.run_step = noted
    return seen


def _weights(trainer: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


class Flaky(ft.OneReplica):
    """A replica group whose `fail_at`-th commit (from 1) fails, as when a peer dies in the step."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.commits, self.begun = fail_at, 0, []

    def begin(self, step: int) -> None:
        self.begun.append(step)

    def commit(self) -> bool:
        self.commits += 1
        self.committed = self.commits != self.fail_at
        return self.committed


# Planted: the step counted when not committed (`self.step += 1` before the check), and the
# uncommitted step's batches dropped (`again` not kept): both fail.
def test_a_step_no_group_commits_is_not_counted_and_its_batches_are_taken_again(tmp_path):
    plain = _trainer(_config(tmp_path, "plain", train={"max_steps": 8}))
    plain.train()
    trainer = _trainer(_config(tmp_path, "flaky", train={"max_steps": 8}))
    trainer.replicas = Flaky(fail_at=3)
    seen = _batches_seen(trainer)
    result = trainer.train()
    assert result.steps == 8 and trainer.replicas.commits == 9
    # The third step's batches were taken again: nine steps run, the 3rd and 4th on one batch.
    assert len(seen) == 9 and torch.equal(seen[2], seen[3]) and not torch.equal(seen[3], seen[4])
    assert trainer.replicas.begun == [0, 1, 2, 2, 3, 4, 5, 6, 7]
    # No optimizer step, no schedule step for it: the weights are a run's without the failure.
    assert all(torch.equal(a, b) for a, b in zip(_weights(trainer), _weights(plain), strict=True))


class Healing(ft.OneReplica):
    """A replica group that, at its first commit, copies its peer's state (the Trainer's
    `state_dict` and its weights and optimizer, as torchft's heal loads them in should_commit)."""

    def __init__(self, peer: Any) -> None:
        self.peer = peer
        self.commits = 0
        self._healed = False

    def carry(self, state_dict: Any, load: Any) -> None:
        self.load = load

    def commit(self) -> bool:
        self.commits += 1
        if self.commits == 1:
            self.load(self.peer.state_dict())
            self._healed = True
        return True

    def healed(self) -> bool:
        healed, self._healed = self._healed, False
        return healed


# Planted: the data iterator left where it was after a heal (`_batches` not called again), and
# moved but in the epoch the loop had started (`self._batches(epoch)`): both fail.
def test_a_heal_moves_the_loop_to_its_peers_position_across_an_epoch(tmp_path):
    peer = _trainer(_config(tmp_path, "peer", train={"max_steps": 8}))
    peer.train()  # 8 steps: epoch 1, its 2nd batch done
    ahead = _trainer(_config(tmp_path, "peer", train={"max_steps": 11}))  # the peer, resumed: steps 9-11
    ahead_seen = _batches_seen(ahead)
    ahead.train()
    healing = _trainer(_config(tmp_path / "other", "healing", train={"max_steps": 11}))
    healing.replicas = Healing(peer)
    healing.replicas.carry(None, healing.load_state_dict)
    seen = _batches_seen(healing)
    result = healing.train()
    # Its first step was the heal's (the peer's step 9, read at its own old position); from then
    # on it reads what the peer read, in the peer's epoch, and ends where the peer ends.
    assert result.steps == 11 and result.epochs == peer.epoch == 1
    assert healing.batch_in_epoch == ahead.batch_in_epoch == 5
    assert len(seen) == len(ahead_seen) == 3 and all(
        torch.equal(a, b) for a, b in zip(seen[1:], ahead_seen[1:], strict=True)
    )


# Planted: group index + rank (not index x size + rank): fails.
def test_the_groups_data_ranks_are_ddps_over_the_whole_run():
    """Group g's rank r reads DDP rank g x size + r's shard of count x size (2 groups of 2 here)."""
    data = list(range(40))
    for index in range(2):
        for rank in range(2):
            ranks = ft.train_ranks(_GroupRanks(rank, 2), _Replicas(ft.ReplicaGroup(index, 2, "")))
            ours = DistributedSampler(data, num_replicas=ranks.world_size, rank=ranks.rank, seed=3)
            ddp = DistributedSampler(data, num_replicas=4, rank=index * 2 + rank, seed=3)
            assert list(ours) == list(ddp)
    alone = _GroupRanks(1, 2)
    assert ft.train_ranks(alone, ft.OneReplica()) is alone


class _GroupRanks:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


class _Replicas(ft.OneReplica):
    def __init__(self, group: ft.ReplicaGroup) -> None:
        self.group = group


def test_the_replica_group_is_the_launchers_environment(monkeypatch):
    for key in (ft.GROUP_ENV, ft.GROUPS_ENV, ft.LIGHTHOUSE_ENV):
        monkeypatch.delenv(key, raising=False)
    assert ft.replica_group() is None and ft.world_of(3) == 3
    monkeypatch.setenv(ft.GROUP_ENV, "1")
    monkeypatch.setenv(ft.GROUPS_ENV, "2")
    monkeypatch.setenv(ft.LIGHTHOUSE_ENV, "http://h:1")
    assert ft.replica_group() == ft.ReplicaGroup(1, 2, "http://h:1") and ft.world_of(3) == 6
    monkeypatch.setenv(ft.GROUP_ENV, "2")
    with pytest.raises(ValueError, match="RAYLANE_REPLICA_GROUP = 2: not a group of RAYLANE_REPLICA_GROUPS = 2"):
        ft.replica_group()


@pytest.fixture
def one_group(monkeypatch):
    """This process as replica group 0 of 1, with torchft's lighthouse here on 127.0.0.1."""
    monkeypatch.setenv("RUST_LOG", "warn")
    coordination = pytest.importorskip("torchft.coordination", reason="needs raylane[fault-tolerance]")
    lighthouse = coordination.LighthouseServer(bind="127.0.0.1:0", min_replicas=1, quorum_tick_ms=20)
    env = {ft.GROUP_ENV: "0", ft.GROUPS_ENV: "1", ft.LIGHTHOUSE_ENV: lighthouse.address(), "MASTER_ADDR": "127.0.0.1"}
    try:
        yield env
    finally:
        lighthouse.shutdown()


# Planted: the Manager not told the step resumed at (joined() without load_state_dict): the run
# from a step-3 checkpoint stops at its first step, its Manager at 0 ("the loop is at step 3").
def test_one_replica_group_is_the_plain_run_and_checkpoints_cross_both_ways(tmp_path, one_group, monkeypatch):
    cfg = {"train": {"max_steps": 6}, "checkpoint": {"every_n_steps": 3}}
    plain = _trainer(_config(tmp_path, "plain", **cfg))
    plain.train()
    with monkeypatch.context() as env:
        for key, value in one_group.items():
            env.setenv(key, value)
        grouped = _trainer(_config(tmp_path, "grouped", fault_tolerance={"enabled": True, "replica_groups": 1}, **cfg))
        assert isinstance(grouped.replicas, ft.ReplicaGroups)
        grouped.train()
        # Back into a group from the plain run's step 3.
        rejoined = _trainer(
            _config(
                tmp_path,
                "rejoined",
                fault_tolerance={"enabled": True, "replica_groups": 1},
                **{**cfg, "checkpoint": {"init_from": str(tmp_path / "plain" / "checkpoint_000000003")}},
            )
        )
        assert rejoined.step == 3
        rejoined.train()
    # Out of the group from the grouped run's step 3.
    left = _trainer(
        _config(
            tmp_path, "left", **{**cfg, "checkpoint": {"init_from": str(tmp_path / "grouped" / "checkpoint_000000003")}}
        )
    )
    assert left.step == 3 and not isinstance(left.replicas, ft.ReplicaGroups)
    left.train()
    for other in (grouped, rejoined, left):
        assert other.step == 6
        assert all(torch.equal(a, b) for a, b in zip(_weights(other), _weights(plain), strict=True))
    assert sorted(p.name for p in (tmp_path / "grouped").glob("checkpoint_*")) == [
        "checkpoint_000000003",
        "checkpoint_000000006",
    ]
    assert os.environ.get(ft.GROUP_ENV) is None
