"""What raylane reads of its own processes through psutil (issue 61: no hand-made /proc reader in
app/) against the /proc readers it replaced, kept here as they were: a process's start on the wall
clock (the start-up phases: raylane.loop.observe.startup) and this process's resident set
(autotune's memory: raylane.autotuning.memory). The cluster's and the warm pool's are
tests/unit/test_local_cluster.py and test_warm_processes.py."""

from __future__ import annotations

import mmap
import os
import subprocess
import time
from pathlib import Path

from raylane.autotuning.memory import rss
from raylane.loop.observe.startup import process_start_unix

TICK_S = 1 / os.sysconf("SC_CLK_TCK")
APP = Path(rss.__code__.co_filename).resolve().parents[1]
# The one path under /proc left, with why: it is no process's data but the pid namespace's identity
# (its inode), which neither psutil nor the os module names.
NAMESPACE = {"onray/leftovers.py": 'os.stat("/proc/self/ns/pid")'}


def proc_start_unix(pid: int | str = "self") -> float | None:
    """startup.process_start_unix before issue 61."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def proc_rss() -> int:
    """memory.rss before issue 61."""
    import resource

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_a_processs_start_is_the_one_the_proc_reader_told_to_the_clock_tick():
    """To the tick, not the second: psutil's own create_time is off by up to 1 s (whole-second
    boot time), which would move every start-up phase measured from a process's start."""
    child = subprocess.Popen(["sleep", "30"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        # /proc/uptime has hundredths of a second: the old reading is that much coarser.
        for pid, old in ((None, proc_start_unix()), (os.getppid(), proc_start_unix(os.getppid()))):
            new = process_start_unix(pid)
            assert new is not None and old is not None and abs(new - old) <= 0.01 + TICK_S, (pid, new, old)
        new, old = process_start_unix(child.pid), proc_start_unix(child.pid)
        assert new is not None and old is not None and abs(new - old) <= 0.01 + TICK_S
        assert abs(new - time.time()) < 60  # started moments ago, by the clock
        assert process_start_unix(gone.pid) is None is proc_start_unix(gone.pid)
    finally:
        child.kill()
        child.wait()


def test_the_resident_set_is_the_one_the_proc_reader_counted():
    empty = rss()
    # Pages of a new anonymous mapping, written: 64 MiB more resident. (A bytes object could land
    # in heap a long-lived test worker already holds resident: seen, 0 bytes more at 1 GiB.)
    block = mmap.mmap(-1, 64 * 1024**2)
    block.write(b"\x01" * len(block))
    before, now, after = proc_rss(), rss(), proc_rss()
    assert min(before, after) - 1024**2 <= now <= max(before, after) + 1024**2
    assert now - empty >= 60 * 1024**2, (now, empty)
    block.close()


def test_no_module_reads_proc_by_hand():
    """psutil (a dependency) reads processes: a hand-made /proc reader is one more to keep up with
    the kernel's formats. Seen failing before issue 61 on clusters/local.py, onray/slurm.py,
    loop/observe/startup.py and autotuning/memory.py."""
    found = []
    for path in sorted(APP.rglob("*.py")):
        name = path.relative_to(APP).as_posix()
        text = path.read_text().replace(NAMESPACE.get(name, "\0"), "")
        found += [f"{name}:{n}" for n, line in enumerate(text.splitlines(), 1) if "/proc" in line.split("#")[0]]
    assert found == []
    assert all(what in (APP / name).read_text() for name, what in NAMESPACE.items())  # still there, still needed
