"""B15's measurements (scripts/benchmarks/driverscale.py says what each path is fed, and how):
each of the driver's paths at N simulated ranks, in this process; `measure(n, windows)` all six."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import random
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PER_NODE = 8
GPUS = 8
WINDOWS = 300  # --quick: 100


class Wire:
    """Counts what rank 0's collectives carry while inside: per call, the bytes rank 0 sends or
    receives (an all-reduce's and a broadcast's buffer; an all-gather's and a gather's every part)."""

    NAMES = ("all_reduce", "all_gather", "gather", "broadcast", "all_gather_object", "broadcast_object_list")

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def counting(self) -> Iterator[Wire]:
        import torch.distributed as dist

        saved = {name: getattr(dist, name) for name in self.NAMES}

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def counted(*args: Any, **kwargs: Any) -> Any:
                out = fn(*args, **kwargs)
                self.calls.append((name, _bytes(name, args, kwargs)))
                return out

            return counted

        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.calls)


def _bytes(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    first = args[0] if args else next(iter(kwargs.values()))
    if name in ("all_reduce", "broadcast"):
        return first.numel() * first.element_size()
    if name == "all_gather":
        return sum(t.numel() * t.element_size() for t in first)
    if name == "gather":
        parts = kwargs.get("gather_list") or (args[1] if len(args) > 1 else None)
        return sum(t.numel() * t.element_size() for t in parts) if parts else first.numel() * first.element_size()
    return sum(len(pickle.dumps(o)) for o in first)  # the object collectives: each object's pickle


@contextlib.contextmanager
def fake_group(world: int) -> Iterator[None]:
    """torch's `fake` process group of `world` ranks, this process as rank 0 (shapes only: nothing sent)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", world_size=world, rank=0, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def lines_run(fn: Callable[[], Any]) -> int:
    """Python lines executed by `fn()`: the work a call does, counted, not timed (the same on
    every machine; a loop over the ranks inside a loop over the ranks shows as N²)."""
    count = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


class Entries:
    """A MetricLogger's interface, counting what would reach MLflow."""

    def __init__(self) -> None:
        self.metrics = 0
        self.tags = 0
        self.ready = type("Ready", (), {"is_set": staticmethod(lambda: True)})()

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.metrics += len(metrics)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.tags += len(tags)

    set_first_tags = set_tags

    def take(self) -> dict[str, int]:
        out = {"metrics": self.metrics, "tags": self.tags}
        self.metrics = self.tags = 0
        return out


# -- 1. step times and stragglers ------------------------------------------------------------


def step_rows(n: int, rng: random.Random, slow: range) -> list[float]:
    """The vote's per-rank block of a window (steptimes.FIGURES per rank, in rank order): 10 steps
    of ~0.1 s; the ranks in `slow` reach the gradient sync late, busy 2x as long."""
    values: list[float] = []
    for rank in range(n):
        busy = 0.1 * (2.0 if rank in slow else 1.0) * (1 + 0.02 * rng.random())
        arrive = busy * 0.8
        values += [10.0, 0.2, 0.01, arrive, busy * 0.9, busy * 0.1]
    return values


def step_times(n: int, windows: int, *, memory: bool = True) -> dict[str, Any]:
    """Rank 0's work on a window's gathered step times, and what it sends to MLflow and the driver
    (`memory`: its growth over the windows, traced: slower)."""
    from raylane.loop.observe.steptimes import FIGURES, StepTimes
    from raylane.loop.reporting import Reporter

    events: list[Any] = []
    entries = Entries()
    reporter = Reporter(is_rank_zero=True, publish=events.append, metric_logger=entries)
    times = StepTimes(10, 1.5, 3, active=True, sink=reporter)
    times.start(0, [f"node{r // PER_NODE}" for r in range(n)])
    rng = random.Random(0)
    slow = range(PER_NODE, 2 * PER_NODE) if n > PER_NODE else range(1, 2)
    rows = [step_rows(n, rng, slow) for _ in range(8)]
    walls, per_window = [], []
    for w in range(windows):
        started = time.perf_counter()
        times.gathered(10 * (w + 1), rows[w % len(rows)], n)
        walls.append(time.perf_counter() - started)
        per_window.append(entries.take())
    grown = 0
    if memory:  # as many windows again, traced (tracemalloc slows every allocation: not timed)
        tracemalloc.start()
        for w in range(windows, 2 * windows):
            if w == windows + 10:
                base = tracemalloc.get_traced_memory()[0]
            times.gathered(10 * (w + 1), rows[w % len(rows)], n)
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
    lines = lines_run(lambda: times.gathered(10 * (2 * windows + 1), rows[0], n))
    return {
        "window_ms": min(walls) * 1e3,  # the least disturbed window: the machine is shared
        "lines": lines,
        "mlflow_per_window": per_window[-1],
        "mlflow_max_window": max(e["metrics"] + e["tags"] for e in per_window),
        "stragglers_named": len(times.watch.named),
        "driver_events": len(events),
        "memory_growth_bytes": grown,
        "vote_block_bytes": 8 * len(FIGURES) * n,
    }


def vote_bytes(n: int, per_rank: int) -> int:
    """The step-boundary vote's bytes on rank 0 at world size n (fake group), with `per_rank`
    figures of each rank riding on it (a window's step times: 6; a vote between windows: 0)."""
    from raylane.loop.stopping import StepVote

    runtime = type("Runtime", (), {"rank": 0, "world_size": n, "restarts_without_leaving_nodes": False})()
    wire = Wire()
    with fake_group(n), wire.counting():
        vote = StepVote(runtime)
        vote.poll(10, False, tuple([0.1] * per_rank))
    return wire.bytes


# -- 2. hangs and stacks ----------------------------------------------------------------------


def dump(rank: int, stuck: bool) -> str:
    """A faulthandler dump as a rank's watchdog writes it: its training thread in a collective
    (or, `stuck`, in the user's code), and a helper thread."""
    inner = (
        ['  File "/work/pipelines/mine.py", line 42 in forward']
        if stuck
        else [
            '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce',
            '  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 823 in _engine_run_backward',
        ]
    )
    frames = [*inner, *(f'  File "/app/raylane/loop/trainer.py", line {200 + i} in run_step' for i in range(12))]
    helper = ['  File "/usr/lib/python3.11/threading.py", line 320 in wait'] * 4
    return (
        f"Thread 0x{1000 + rank:016x} (most recent call first):\n" + "\n".join(frames) + "\n\n"
        "Thread 0x00007f0000000001 (most recent call first):\n" + "\n".join(helper) + "\n"
    )


class VirtualClock:
    """`time` as hangs.py uses it, whose sleeps pass at once and are added up (`waited`)."""

    def __init__(self) -> None:
        self.waited = 0.0

    def sleep(self, seconds: float) -> None:
        self.waited += seconds

    def monotonic(self) -> float:
        return time.monotonic() + self.waited

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def peers_folder(folder: Path, n: int, stuck: int) -> None:
    """The run folder as the other ranks leave it at a hang: their records (on other hosts:
    nothing here signals them) and their watchdogs' dumps."""
    ranks = folder / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    for r in range(1, n):
        node = f"node{r // PER_NODE}"
        record = {"rank": r, "pid": 10_000 + r, "host": f"{node}-elsewhere", "thread": 1000 + r, "node": node}
        (ranks / f"rank{r}.json").write_text(json.dumps(record))
        (ranks / f"rank{r}.watchdog").write_text(dump(r, r == stuck))


def hang(n: int, repeats: int = 3) -> dict[str, Any]:
    """The least disturbed of `repeats` diagnoses (`one_hang`): the machine is shared."""
    runs = [one_hang(n) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["rank_ms"])
    counted = one_hang(n, count=True)  # the lines each rank's diagnosis executes (traced: not timed)
    return {**best, "other_rank_ms": min(r["other_rank_ms"] for r in runs), **counted["lines_executed"]}


def one_hang(n: int, *, count: bool = False) -> dict[str, Any]:
    """A timed-out collective's diagnosis by the first rank (it collects every rank's stacks and
    writes the line) and by a second (which fails with that line), with the other ranks' dumps in
    the run folder; rank `n // 2 + 3` stuck in user code. Every rank but the stuck one times out:
    the whole run's files are the first's and (n - 2) times the second's."""
    from raylane.loop.observe import hangs

    with tempfile.TemporaryDirectory(prefix="raylane-b15-") as tmp:
        folder = Path(tmp)
        peers_folder(folder, n, stuck=n // 2 + 3 if n > 2 else 1)
        first = hangs.HangWatch(str(folder), 0, n, 60.0)
        second = hangs.HangWatch(str(folder), n - 1, n, 60.0)
        first.start()
        second.start()
        peers_folder(folder, n, stuck=n // 2 + 3 if n > 2 else 1)  # the second as on another host
        timeout = RuntimeError("Timed out waiting 60000ms for recv operation to complete")
        clock, real = VirtualClock(), hangs.time
        hangs.time = clock  # type: ignore[assignment]
        try:
            walls, waits, written, lines, executed = [], [], [], [], []
            for watch in (first, second) if n > 2 else (first,):
                before, started, clock.waited = _files(folder / "stacks"), time.perf_counter(), 0.0
                diagnose = lambda w=watch: lines.append(str(w.diagnose(timeout)))  # noqa: E731
                executed.append(lines_run(diagnose) if count else diagnose())
                walls.append(time.perf_counter() - started)
                waits.append(clock.waited)
                written.append(len(_files(folder / "stacks") - before))
        finally:
            hangs.time = real
            first.close()
            second.close()
        stacks = list((folder / "stacks").iterdir())
        return {
            "rank_ms": walls[0] * 1e3,
            "other_rank_ms": walls[-1] * 1e3,
            "rank_waited_s": max(waits),
            "wait_bound_s": hangs.ANSWER_WAIT_S,
            "stack_files_written": written[0],
            "stack_bytes_written": sum(p.stat().st_size for p in stacks),
            "line_chars": len(lines[0]),
            "line": lines[0][:300],
            "same_line": len(set(lines)) == 1,
            "lines_executed": {"rank_lines": executed[0], "other_rank_lines": executed[-1]} if count else {},
            "run_files_written": written[0] + max(n - 2, 0) * written[-1],
        }


def _files(folder: Path) -> set[tuple[str, float]]:
    """Each file's name and time: a file written again counts as written."""
    return {(p.name, p.stat().st_mtime_ns) for p in folder.iterdir()} if folder.is_dir() else set()


# -- 3. the preemption vote --------------------------------------------------------------------


def preemption(n: int) -> dict[str, Any]:
    return {"vote_bytes": vote_bytes(n, 0), "vote_with_window_bytes": vote_bytes(n, 6)}


# -- 4. the checkpoint's commit ----------------------------------------------------------------


def part(rank: int) -> dict[str, Any]:
    """A rank's part of a sharded save's commit, as `PendingSave.commit` gathers it."""
    digest = f"{rank:064x}"
    files = {
        f"__{rank}_0.distcp": {"size": 123_456_789, "sha256": digest},
        f"rng_{rank}.json": {"size": 20_000, "sha256": digest},
    }
    return {"files": files, "error": None, "rng": None, "shapes": None}


@contextlib.contextmanager
def ranks_send(payloads: list[bytes]) -> Iterator[None]:
    """The other ranks' side of the commit's gather (raylane.loop.checkpoint.agree) on the fake
    group: the longest of their JSON `payloads` (rank order) in the all-reduce before it, and each
    one, as agree frames it (its length in 8 bytes, then the JSON), in rank 0's gather list."""
    import torch
    import torch.distributed as dist

    reduce, gather = dist.all_reduce, dist.gather
    longest = max(map(len, payloads))

    def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        out = reduce(tensor, *args, **kwargs)
        if tensor.dtype == torch.int64 and tensor.numel() == 2:  # (longest part, any failed)
            tensor[0] = max(int(tensor[0]), longest)
        return out

    def gathered(tensor: Any, gather_list: Any = None, *args: Any, **kwargs: Any) -> Any:
        out = gather(tensor, gather_list, *args, **kwargs)
        for rank, data in enumerate(payloads[1:], start=1):
            frame = gather_list[rank]
            frame.zero_()
            frame[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            frame[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out

    dist.all_reduce, dist.gather = all_reduce, gathered
    try:
        yield
    finally:
        dist.all_reduce, dist.gather = reduce, gather


def commit(n: int, repeats: int = 6) -> dict[str, Any]:
    """A sharded save's commit on the fake group, as rank 0 does it (every rank's part gathered,
    the manifest of n ranks' files built and written durably), and an upload's agreement."""
    from raylane.loop.checkpoint import writing
    from raylane.loop.checkpoint.agree import raise_if_any

    payloads = [json.dumps(part(r)).encode() for r in range(n)]
    walls = []
    with tempfile.TemporaryDirectory(prefix="raylane-b15-") as tmp:
        for i in range(repeats):
            path = Path(tmp, f"checkpoint_{i:09d}")
            path.mkdir()
            for name in ("__0_0.distcp", "rng_0.json", ".metadata"):
                (path / name).write_bytes(b"x" * 1000)
            wire = Wire()
            with fake_group(n), ranks_send(payloads), wire.counting():
                save = writing.PendingSave(path, 0, {"step": i, "epoch": 0})
                if i == repeats - 1:  # the last: its lines executed (traced: not timed)
                    lines = lines_run(save.commit)
                else:
                    started = time.perf_counter()
                    save.commit()
                    walls.append(time.perf_counter() - started)
                commit_bytes, wire.calls = wire.bytes, []
                raise_if_any(i, None)  # an upload's agreement (storage.CheckpointStore._upload)
        manifest = json.loads((path / "manifest.json").read_text())
        return {
            "commit_bytes": commit_bytes,
            "agree_bytes": wire.bytes,
            "manifest_bytes": (path / "manifest.json").stat().st_size,
            "manifest_files": len(manifest["files"]),
            "commit_ms": min(walls) * 1e3,
            "commit_lines": lines,
        }


# -- 5. MLflow: a window's records, and the nodes' health ---------------------------------------

WINDOW_METRICS = {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "samples_per_s": 1e4, "tokens_per_s": 1e6, "mfu": 0.4}


def health_sample(t: float, n: int) -> dict[str, Any]:
    """A node's sample as raylane.loop.observe.health writes it: CPU, memory, disk, network, 8 GPUs."""
    gpu = {"utilization_percent": 90.0, "memory_used_gb": 60.0, "memory_percent": 75.0, "power_w": 600.0,
           "temperature_c": 70.0}  # fmt: skip
    sample: dict[str, Any] = {"t": t, "n": n, "cpu_percent": 50.0, "memory_percent": 40.0, "memory_used_gb": 800.0,
                              "disk_percent": 20.0, "disk_free_gb": 1000.0, "network_receive_mb_s": 100.0,
                              "network_transmit_mb_s": 100.0}  # fmt: skip
    for i in range(GPUS):
        sample.update({f"gpu{i}_{k}": v for k, v in gpu.items()})
    return sample


def write_health(folder: Path, nodes: int, round_: int) -> None:
    from raylane.loop.observe.health import KEEP, file_name

    for node in range(nodes):
        name = f"node{node}"
        samples = [health_sample(1_000_000.0 + 10 * k, k) for k in range(max(round_ - KEEP + 1, 0), round_ + 1)]
        (folder / file_name(name)).write_text(json.dumps({"node": name, "interval_s": 10.0, "samples": samples}))


def mlflow(n: int, windows: int) -> dict[str, Any]:
    """What a logging window sends to MLflow from rank 0 (its train metrics; the step times' are
    `step_times`'), and what one health interval of N/8 nodes sends from the driver."""
    import pyarrow.fs as pafs

    from raylane.loop.reporting import Reporter
    from raylane.tracking.health import HealthWatch

    entries = Entries()
    reporter = Reporter(is_rank_zero=True, publish=lambda e: None, metric_logger=entries)
    for w in range(windows):
        reporter.on_train_metrics(10 * (w + 1), dict(WINDOW_METRICS))
    train = entries.take()["metrics"] / windows
    nodes = max(n // PER_NODE, 1)
    with tempfile.TemporaryDirectory(prefix="raylane-b15-") as tmp:
        folder = Path(tmp)
        write_health(folder, nodes, 0)
        health = HealthWatch(pafs.LocalFileSystem(), str(folder), 10.0, 3, entries.log, entries.set_tags)
        health.poll()
        entries.take()
        polls, walls = 10, []
        for k in range(1, polls + 1):
            write_health(folder, nodes, k)
            started = time.perf_counter()
            health.poll()
            walls.append(time.perf_counter() - started)
        per_interval = entries.take()
        write_health(folder, nodes, polls + 1)
        lines = lines_run(health.poll)  # traced: not timed
    return {
        "train_metrics_per_window": train,
        "health_metrics_per_interval": per_interval["metrics"] / polls,
        "health_poll_ms": min(walls) * 1e3,
        "health_poll_lines": lines,
        "nodes": nodes,
    }


# -- 6. the events from the ranks to the driver --------------------------------------------------


def events(n: int) -> dict[str, Any]:
    """A window's events (rank 0's progress, at most every 0.5 s) as the driver gets them, and
    the start's: one Startup from each rank (onray/launch.py), a warning every rank relays."""
    from raylane.loop.protocols.events import Event, Log, Progress, Start, Startup
    from raylane.tracking.progress import ProgressDisplay

    state = {"total_steps": 10_000, "steps_per_epoch": 1000, "max_epochs": 10, "world_size": n, **WINDOW_METRICS}
    window = Progress(epoch=0, step=100, window={"first_step": 91, "last_step": 100, "loss": 2.0}, state=state)
    start = [Startup(phases={}, processes={f"rank {r}": 1_000_000.0 + r}) for r in range(n)]
    same = [Log(rank=r, level="warning", message="data loader slow: 2 workers") for r in range(n)]
    own = [Log(rank=r, level="warning", message=f"health of node node{r // PER_NODE} not written") for r in range(n)]
    out = io.StringIO()
    display = ProgressDisplay(stream=out, live=False)
    display.handle(Start(total_steps=10_000, steps_per_epoch=1000, max_epochs=10, world_size=n, host="node0"))
    started = time.perf_counter()
    relayed: list[Event] = [window, *same, *own]
    for event in relayed:
        display.handle(event)
    wall = time.perf_counter() - started
    lines = out.getvalue().splitlines()
    return {
        "window_bytes": len(pickle.dumps(window)),
        "start_bytes": sum(len(pickle.dumps(e)) for e in start),
        "driver_ms": wall * 1e3,
        "warning_lines_same_text": sum("data loader slow" in line for line in lines),
        "warning_lines_per_node_text": sum("health of node" in line for line in lines),
    }


# -- all six ------------------------------------------------------------------------------------


def measure(n: int, windows: int) -> dict[str, Any]:
    return {
        "step_times": {**step_times(n, windows), "vote_bytes": vote_bytes(n, 6)},
        "hang": hang(n),
        "preemption": preemption(n),
        "checkpoint": commit(n),
        "mlflow": mlflow(n, windows),
        "events": events(n),
    }
