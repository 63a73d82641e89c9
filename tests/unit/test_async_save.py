"""Asynchronous checkpoints in one process: what the loop hands to the background thread is a copy
taken at the save's step, nothing is committed before every file is written, and a failed save is
reported (or raised) when the loop settles it, as with a synchronous save."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from raylane.config import CheckpointSection
from raylane.loop import checkpoint
from raylane.loop.checkpoint import writing
from raylane.loop.checkpoint.saving import Saver
from raylane.loop.checkpoint.storage import CheckpointStore
from raylane.loop.observe.faults import Fault, FaultPlan
from raylane.loop.protocols.events import Checkpoint, CheckpointFailed, Event
from raylane.loop.reporting import Reporter


def _setup(tmp_path: Path, **section):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    events: list[Event] = []
    saver = Saver(
        CheckpointStore(str(tmp_path / "run"), None, 0),
        CheckpointSection(**section),
        Reporter(is_rank_zero=True, publish=events.append),
    )
    return model, optimizer, saver, events


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saver: Saver | None = None) -> None:
    optimizer.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    if saver is not None:
        saver.wait_staged()  # as the Trainer does: the copy in flight completes before the state changes
    optimizer.step()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        out[f"momentum.{i}"] = s["momentum_buffer"].clone()
    return out


def test_staged_copy_is_unaffected_by_later_steps(tmp_path, monkeypatch):
    model, optimizer, saver, events = _setup(tmp_path)
    for _ in range(2):
        _step(model, optimizer)
    at_save = _state(model, optimizer)
    release = threading.Event()
    real_write = writing.write

    def held_write(*args, **kwargs):
        release.wait(30)
        return real_write(*args, **kwargs)

    monkeypatch.setattr(writing, "write", held_write)  # where the Saver calls it
    saver.save(model, optimizer, {"step": 2, "epoch": 0})
    assert saver.busy()
    saver.wait_staged()
    for _ in range(3):  # the weights and momentum change in place while the save waits
        _step(model, optimizer, saver)
    assert not torch.equal(_state(model, optimizer)["model.0.weight"], at_save["model.0.weight"])
    release.set()
    saver.settle()
    assert [type(e) for e in events] == [Checkpoint] and events[0].step == 2

    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    _step(fresh, fresh_optimizer)  # creates the momentum buffers that load fills in
    checkpoint.load(saver.last_checkpoint, fresh, fresh_optimizer)
    loaded = _state(fresh, fresh_optimizer)
    assert loaded.keys() == at_save.keys()
    for name, value in at_save.items():
        assert torch.equal(loaded[name], value), name


def test_buffers_are_reused_and_each_save_has_its_own_step(tmp_path):
    model, optimizer, saver, _ = _setup(tmp_path)
    states = {}
    for step in (1, 2, 3):
        _step(model, optimizer, saver)
        states[step] = _state(model, optimizer)
        saver.save(model, optimizer, {"step": step, "epoch": 0})
    saver.settle()
    for step, want in states.items():
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        checkpoint.load(
            str(tmp_path / "run" / checkpoint.checkpoint_name(step)),
            fresh,
            torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9),
        )
        assert torch.equal(fresh[0].weight, want["model.0.weight"]), step


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_save_is_reported_or_raised_when_settled(tmp_path, async_save):
    model, optimizer, saver, events = _setup(tmp_path, async_save=async_save, on_error="warn")
    saver.faults = FaultPlan([Fault("diskfull", 2, 0)], rank=0)
    for step in (1, 2, 3):
        _step(model, optimizer, saver)
        saver.save(model, optimizer, {"step": step, "epoch": 0})
    saver.settle()
    assert [(type(e), e.step) for e in events] == [(Checkpoint, 1), (CheckpointFailed, 2), (Checkpoint, 3)]
    assert "No space left on device" in events[1].error and saver.failed == 1
    assert [Path(p).name for p in checkpoint.committed(str(tmp_path / "run"))] == [
        checkpoint.checkpoint_name(1),
        checkpoint.checkpoint_name(3),
    ]
    assert not (tmp_path / "run" / checkpoint.checkpoint_name(2)).exists()

    model, optimizer, failing, _ = _setup(tmp_path / "fail", async_save=async_save, on_error="fail")
    failing.faults = FaultPlan([Fault("diskfull", 1, 0)], rank=0)
    with pytest.raises(checkpoint.CheckpointSaveError, match="checkpoint at step 1 was not saved"):
        failing.save(model, optimizer, {"step": 1, "epoch": 0})
        failing.settle()
