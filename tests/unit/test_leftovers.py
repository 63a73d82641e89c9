"""A Ray worker asks whether its run's driver is alive before each checkpoint (issue 47, finding
12): a process that ended, or a pid another process has taken since, is a driver gone. The whole
of it on Ray, with a driver killed by SIGKILL: tests/e2e/test_leftovers.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from raylane.loop.checkpoint import checkpoint_name
from raylane.onray.leftovers import DriverGone, DriverWatch, ProcessId
from raylane.onray.store import DriverWatchedStore


def test_a_worker_stops_before_a_checkpoint_once_its_driver_is_gone():
    me = ProcessId.here()
    DriverWatch(me).check("the checkpoint at step 5")  # alive: nothing to say

    reused = dataclasses.replace(me, started_unix=me.started_unix - 60)  # the pid, now another process's
    ended = dataclasses.replace(me, pid=2**22 + 17)  # above Linux's pid_max: no such process
    for driver in (reused, ended):
        with pytest.raises(DriverGone, match=rf"the run's driver \(pid {driver.pid} on \S+\) is gone: the checkpoint"):
            DriverWatch(driver).check("the checkpoint at step 10")

    # Another machine's (or pid namespace's) pid says nothing here: without an actor the driver
    # owns to ask, the worker goes on (Ray ends a dead driver's job there itself).
    elsewhere = dataclasses.replace(ended, host=f"not-{ended.host}")
    assert not DriverWatch(elsewhere).gone()
    assert not DriverWatch(dataclasses.replace(ended, pid_namespace=ended.pid_namespace + 1)).gone()


def test_a_ray_workers_store_makes_no_checkpoint_folder_once_its_driver_is_gone(tmp_path):
    """The check is made by the store a Ray worker's loop saves through (Runtime.store)."""
    me = ProcessId.here()
    assert Path(DriverWatchedStore(str(tmp_path), None, 0, DriverWatch(me)).new_dir(5)).is_dir()
    ended = DriverWatch(dataclasses.replace(me, pid=2**22 + 17))
    with pytest.raises(DriverGone, match="the checkpoint at step 10 is not written"):
        DriverWatchedStore(str(tmp_path), None, 0, ended).new_dir(10)
    assert not (tmp_path / checkpoint_name(10)).exists()
