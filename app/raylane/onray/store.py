"""The checkpoint store of a Ray Train worker: raylane's own (raylane.loop.checkpoint.storage),
which also stops writing once the run's driver is gone."""

from __future__ import annotations

import pyarrow.fs as pafs

from raylane.loop.checkpoint.storage import CheckpointStore
from raylane.onray.leftovers import DriverWatch


class DriverWatchedStore(CheckpointStore):
    """raylane's CheckpointStore on a Ray Train worker, which writes no checkpoint once the
    run's driver is gone: a killed driver's workers trained on for seconds, writing checkpoints
    nobody recorded.

    Nothing else goes to Ray. Resuming reads this store, not ray.train.get_checkpoint(): Ray
    records a checkpoint only when its controller processes the report, which a driver killed
    right after the upload never does; our manifest, checked against every file, is the
    authority. And a commit makes no ray.train.report: in Ray 2.60 every report is a barrier
    across the ranks and then waits for the controller's next poll (a result queue of one),
    ~0.45 s of stall per checkpoint on 2 cores. Nothing needs it: raylane keeps its checkpoints
    and their retention itself, and metrics reach the driver and Tune through rank 0's events."""

    def __init__(self, root: str, fs: pafs.FileSystem | None, rank: int, driver: DriverWatch) -> None:
        super().__init__(root, fs, rank)
        self._driver = driver

    def new_dir(self, step: int) -> str:
        self._driver.check(f"the checkpoint at step {step}")
        return super().new_dir(step)
