"""A process that dies between an async save's files and its commit leaves the previous checkpoint
the latest (the async save in one process: tests/unit/test_async_save.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from raylane.loop import checkpoint

CRASH = textwrap.dedent("""
    import os, sys, torch
    from raylane.config import CheckpointSection
    from raylane.loop import checkpoint
    from raylane.loop.reporting import Reporter
    from raylane.loop.checkpoint import writing
    from raylane.loop.checkpoint.saving import Saver
    from raylane.loop.checkpoint.storage import CheckpointStore

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saver = Saver(CheckpointStore(sys.argv[1], None, 0), CheckpointSection(async_save=True), Reporter(is_rank_zero=True, publish=print))
    saver.save(model, optimizer, {"step": 1, "epoch": 0})
    saver.settle()

    def crash(path, manifest):  # every file of step 2 is written; the process dies before the commit
        os._exit(17)

    writing._write_manifest = crash
    saver.save(model, optimizer, {"step": 2, "epoch": 0})
    saver.settle()
""")


def test_a_crash_between_save_start_and_commit_leaves_the_previous_checkpoint_latest(tmp_path):
    root = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", CRASH, str(root)], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 17, proc.stderr
    second = root / checkpoint.checkpoint_name(2)
    assert (second / checkpoint.STATE_FILE).exists() and not (second / checkpoint.MANIFEST_FILE).exists()
    assert checkpoint.latest_valid(str(root)) == str(root / checkpoint.checkpoint_name(1))
