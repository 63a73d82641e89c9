"""A save whose checkpoint folder cannot be made (issue 60, finding 11: a read-only or full file
system at `mkdir`) is the save's failure like a file that cannot be written: agreed at the
commit, handled by `checkpoint.on_error`, named by rank and folder, the committed checkpoint
before it intact. Before, the bare OSError of `mkdir` left the Saver before its error handling
began: `warn` did not apply and the line named no rank.

The fault is real, the kernel's own: a regular file where the step's folder goes (mkdir then
fails with EEXIST). A read-only file system cannot be made here: the tests run as root, whom
chmod does not stop, and mounting one needs privileges a CI machine need not give."""

from __future__ import annotations

import pytest
import torch

from raylane.config import CheckpointSection
from raylane.loop import checkpoint
from raylane.loop.checkpoint.agree import grouped
from raylane.loop.checkpoint.saving import Saver
from raylane.loop.checkpoint.storage import CheckpointStore
from raylane.loop.protocols.events import Checkpoint, CheckpointFailed, Event
from raylane.loop.reporting import Reporter


def _saves(tmp_path, on_error: str, async_save: bool) -> tuple[list[Event], Saver, str]:
    """Saves at steps 1, 2 and 3 of a small model, step 2's folder blocked by a file; returns
    (the events, the Saver, the blocked folder). Raises what the Saver raises."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    events: list[Event] = []
    run = tmp_path / "run"
    saver = Saver(
        CheckpointStore(str(run), None, 0),
        CheckpointSection(on_error=on_error, async_save=async_save),
        Reporter(is_rank_zero=True, publish=events.append),
    )
    run.mkdir()
    blocked = run / checkpoint.checkpoint_name(2)
    blocked.write_text("not a folder\n")
    try:
        for step in (1, 2, 3):
            optimizer.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            saver.wait_staged()
            optimizer.step()
            saver.save(model, optimizer, {"step": step, "epoch": 0})
        saver.settle()
    finally:
        saver.close()
    return events, saver, str(blocked)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_folder_that_cannot_be_made_is_warned_about_naming_the_rank_and_the_run_goes_on(tmp_path, async_save):
    events, saver, blocked = _saves(tmp_path, "warn", async_save)
    assert [(type(e), e.step) for e in events] == [(Checkpoint, 1), (CheckpointFailed, 2), (Checkpoint, 3)]
    error = events[1].error
    assert error == (
        f"checkpoint at step 2 was not saved (rank 0: FileExistsError: [Errno 17] File exists: {blocked!r}) "
        "(checkpoint.on_error: warn)"
    )
    assert saver.failed == 1 and saver.last_checkpoint.endswith(checkpoint.checkpoint_name(3))
    assert (tmp_path / "run" / checkpoint.checkpoint_name(2)).read_text() == "not a folder\n"  # left as it was


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_folder_that_cannot_be_made_fails_the_run_naming_the_rank_and_keeps_the_checkpoint_before(
    tmp_path, async_save
):
    with pytest.raises(checkpoint.CheckpointSaveError) as raised:
        _saves(tmp_path, "fail", async_save)
    assert str(raised.value).startswith("checkpoint at step 2 was not saved (rank 0: FileExistsError: [Errno 17]")
    assert checkpoint.checkpoint_name(2) in str(raised.value) and "\n" not in str(raised.value)
    run = str(tmp_path / "run")
    assert [p.rsplit("/", 1)[1] for p in checkpoint.committed(run)] == [checkpoint.checkpoint_name(1)]
    assert checkpoint.latest_valid(run).endswith(checkpoint.checkpoint_name(1))


def test_ranks_that_failed_alike_are_one_entry_of_the_line():
    """256 ranks on one read-only file system: one entry, not 256 copies in the line."""
    same = [f"rank {r}: OSError: [Errno 30] Read-only file system: '/ck/checkpoint_000000030'" for r in range(256)]
    assert grouped(same) == "ranks 0-255: OSError: [Errno 30] Read-only file system: '/ck/checkpoint_000000030'"
    assert grouped(["rank 1: OSError: x"]) == "rank 1: OSError: x"
    assert (
        grouped(["rank 0: A: b", "rank 1: A: b", "rank 2: C: d", "rank 5: A: b"]) == "ranks 0, 1, 5: A: b; rank 2: C: d"
    )
    assert grouped(["something else"]) == "something else"
