"""Warm workers (issue 52; raylane.onray.warm, raylane.onray.warmpool): what decides that a run's
actors get an empty runtime_env, the head's settings, the start-up line's reasons, stale code, the
refill, and how the pool fills on a head that is never quiet (issue 60: in batches, each once the
last one imported, waiting only for a raylane run that is starting, within the memory and a
budget, saying what it has and why not more). All in-process; a busy head's pool end to end is tests/e2e/test_warm.py."""

from __future__ import annotations

import inspect
import os

import pytest

from raylane.clusters import local
from raylane.loop.observe.startup import StartupTimes
from raylane.loop.protocols.events import Startup
from raylane.onray import internals, raylet, warm, warmpool
from raylane.onray.cluster import TRAIN_ENV_DEFAULTS

TRAIN_VARS = ("RAY_TRAIN_", "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "TORCHFT_LIGHTHOUSE", "NCCL_RAS_ADDR")


def head(**fields) -> local.LocalCluster:
    record = dict(
        address="127.0.0.1:1",
        dashboard_url="http://127.0.0.1:2",
        pid=123,
        temp_dir="/tmp/raylane-x",
        num_cpus=4,
        started_unix=0.0,
        log="head.log",
        warm=7,
        env={k: v for k, v in local.HEAD_ENV.items() if k.startswith(local.TRAIN_ENV_PREFIXES)},
        code="stamp",
        raylet="127.0.0.1:3",
    )
    return local.LocalCluster(**{**record, **fields})


@pytest.fixture
def driver_env(monkeypatch):
    """A driver's environment as raylane's joins a cluster: no Train variable but its defaults."""
    for key in list(os.environ):
        if key.startswith(TRAIN_VARS):
            monkeypatch.delenv(key)
    for key, value in TRAIN_ENV_DEFAULTS.items():
        monkeypatch.setenv(key, value)


def controller_env() -> dict[str, str]:
    wanted = internals.train_env_vars()  # what Ray Train hands its controller, read here
    wanted.setdefault(internals.WARN_ASYNC_GET_VAR, internals.WARN_ASYNC_GET_DEFAULT)
    return warm.carried(wanted, warm.cluster_env())


def test_the_controller_carries_nothing_on_a_raylane_up_head(driver_env, monkeypatch):
    monkeypatch.setattr(warm, "_joined", warm.Pool(head(), None, 7))
    assert controller_env() == {}


def test_the_controller_carries_what_the_cluster_lacks_or_sets_otherwise(driver_env, monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")  # the user's own, unlike the head's 0.5
    monkeypatch.setattr(warm, "_joined", warm.Pool(head(), None, 7))
    assert controller_env() == {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}
    monkeypatch.setattr(warm, "_joined", None)  # an unknown cluster: all of it, as Ray Train gives it
    assert controller_env() == {
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2",
        internals.WARN_ASYNC_GET_VAR: internals.WARN_ASYNC_GET_DEFAULT,
    }


def test_ranks_get_no_runtime_env_for_what_they_inherit(driver_env, monkeypatch):
    from raylane.onray.trainers import WarmWorkerGroup

    # In the controller: the head's environment. Ray Train's own group gives the ranks a copy.
    assert internals.WorkerGroup._get_worker_runtime_env({}) == {"env_vars": dict(TRAIN_ENV_DEFAULTS)}
    assert WarmWorkerGroup._get_worker_runtime_env({}) == {}
    custom = {"env_vars": {"X": "1"}, "py_modules": ["m"]}
    assert WarmWorkerGroup._get_worker_runtime_env(custom) == {"env_vars": {"X": "1"}, "py_modules": ["m"]}


def test_raylanes_controller_launch_is_still_ray_trains():
    """trainers.TrialTorchTrainer._run_controller copies Ray's launch but for the runtime_env: an
    upgrade that changes Ray's must be looked at (and CHECKED_ON extended)."""
    from ray.train.torch import TorchTrainer

    source = inspect.getsource(TorchTrainer._initialize_and_run_controller)
    for line in (
        "env_vars = get_env_vars_to_propagate()",
        "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR",
        "num_cpus=0,",
        "ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()",
        'runtime_env={"env_vars": env_vars},',
        ")(TrainController)",
        "self._register_sigint_handler(controller)",
        "ray.get(controller.run.remote())",
        "return ray.get(controller.get_result.remote())",
    ):
        assert line in source, f"Ray's controller launch changed: {line!r} is gone"
    assert len(source.splitlines()) < 40, "Ray's controller launch grew: compare it with raylane's"


def test_the_head_prestarts_and_preloads_the_loop_and_never_cuda():
    env = local.warm_env(local.warm_pool(4), 4)
    assert env["RAY_enable_worker_prestart"] == "0"  # one per CPU: the pool is prestarted by raylane
    assert env["RAY_prestart_worker_first_driver"] == "0"
    assert env["RAY_preload_python_modules"] == "raylane.onray.preload"  # a job-less worker imports the rest
    preload = local.WARM_PRELOAD
    assert {"torch", "torch._dynamo", "ray.train.torch", "raylane.loop.run", "raylane.onray.launch"} <= set(preload)
    assert not [m for m in preload if "cuda" in m]
    assert int(env["RAY_num_workers_soft_limit"]) >= local.warm_pool(4) + 4  # a run holding every CPU
    assert local.warm_env(0, 4) == {}
    assert (local.warm_pool(4), local.warm_pool(64), local.warm_pool(64, num_gpus=2)) == (7, 11, 5)
    # The head sets what Ray Train would hand its controller: the controller needs no runtime_env.
    assert set(TRAIN_ENV_DEFAULTS.items()) <= set(local.HEAD_ENV.items())
    assert local.HEAD_ENV[internals.WARN_ASYNC_GET_VAR] == internals.WARN_ASYNC_GET_DEFAULT


def test_only_a_job_less_worker_imports_the_warm_modules_and_marks_itself_ready(monkeypatch, tmp_path):
    """Ray's preload runs in every Python worker the head starts: the pool's own (job-less)
    import torch and the loop, marked importing, then ready; one started for a job's actor (a
    sweep's trial, Ray Train's sync actor, Ray Data's) imports nothing it would not have, and
    outside a worker nothing happens."""
    import importlib
    from types import SimpleNamespace

    import ray

    from raylane.onray import preload

    monkeypatch.setenv("RAYLANE_HOME", str(tmp_path))
    imported: list[str] = []
    marks = tmp_path / "warm" / "ready" / str(os.getpid())
    monkeypatch.setattr(importlib, "import_module", lambda name: imported.append(name) or _seen(marks, name))
    importlib.reload(preload)  # this process is no Ray worker
    assert imported == [] and not marks.exists()
    assert not ray.is_initialized()  # asking a process that is no worker for its job started a local Ray (~20 s)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # a worker: Ray imports the preload once connected
    for job, expected in ((ray.JobID.nil().hex(), list(local.WARM_PRELOAD)), ("01000000", [])):
        context = SimpleNamespace(get_job_id=lambda job=job: job)
        monkeypatch.setattr(ray, "get_runtime_context", lambda context=context: context)
        imported.clear()
        importlib.reload(preload)
        assert imported == expected, job
    assert marks.read_text() == ""  # ready: the pool counts it
    assert _SEEN == {name: warmpool.IMPORTING for name in local.WARM_PRELOAD}  # marked importing meanwhile

    def broken(name):
        raise RuntimeError("no torch here")

    monkeypatch.setattr(importlib, "import_module", broken)
    preload.warm_up()
    assert marks.read_text() == "RuntimeError: no torch here"  # the top-up stops and says so


_SEEN: dict[str, str] = {}


def _seen(marks, name) -> None:
    _SEEN[name] = marks.read_text()


def test_a_record_of_an_older_head_reads_as_one_without_warm_workers():
    record = {k: v for k, v in vars(head()).items() if k not in ("warm", "env", "code")}
    assert local.LocalCluster(**record).warm == 0


def test_the_code_stamp_changes_when_raylanes_code_does(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    before = local.code_stamp(tmp_path)
    os.utime(tmp_path / "a.py", ns=(1, 10**18))
    assert local.code_stamp(tmp_path) != before


@pytest.fixture
def on_head(monkeypatch, tmp_path):
    """A `raylane up` head at 127.0.0.1:1 whose pool has two ready workers, 11 and 12, with the
    code it started with, on a machine with memory to spare. A worker the raylet is asked for
    (PrestartWorkers) shows as starting, then importing, then ready, one step per look at the
    pool; every call to prestart records what the pool held then."""
    monkeypatch.setenv("RAYLANE_HOME", str(tmp_path))
    seen = {"ready": [11, 12], "importing": [], "starting": [], "unmarked": [], "gap": [], "recycled": []}
    seen.update(prestarted=[], spawned=0, recorded=[], during=[])

    def pool_workers(sid):
        # starting, then registered but not yet marked (it imports raylane first: in no list, for
        # two looks), then importing, then ready
        state = (list(seen["ready"]), list(seen["importing"]), list(seen["starting"]))
        seen["ready"] += seen["importing"]
        seen["importing"], seen["gap"], seen["unmarked"] = seen["gap"], seen["unmarked"], seen["starting"]
        seen["starting"] = []
        return state

    def prestart(raylet, num):
        seen["during"].append(tuple(len(seen[k]) for k in ("importing", "starting", "unmarked", "gap")))
        seen["prestarted"].append((raylet, num))
        new = 100 + len(seen["prestarted"]) * 10
        seen["starting"] += range(new, new + num)

    def recycle(sid, pids):
        seen["recycled"].extend(pids)
        seen["ready"] = [p for p in seen["ready"] if p not in pids]

    monkeypatch.setattr(local, "running", lambda: head())
    monkeypatch.setattr(local, "code_stamp", lambda: "stamp")
    monkeypatch.setattr(local, "record_code", seen["recorded"].append)
    monkeypatch.setattr(warmpool, "pool_workers", pool_workers)
    monkeypatch.setattr(warmpool, "recycle", recycle)
    monkeypatch.setattr(raylet, "prestart", prestart)
    monkeypatch.setattr(warmpool, "spawn_top_up", lambda: seen.__setitem__("spawned", seen["spawned"] + 1) or True)
    monkeypatch.setattr(warmpool, "BATCH_SETTLE_S", 0)
    monkeypatch.setattr(warmpool, "POLL_S", 0)
    monkeypatch.setattr(warm, "_joined", None)
    monkeypatch.setattr(warmpool.os, "cpu_count", lambda: 2)
    return seen


def test_the_start_up_line_says_warm_or_why_cold(on_head, monkeypatch):
    assert warm.joined("127.0.0.1:1", {}) == "warm start: 2 warm workers ready on the head"
    on_head["starting"] = [13]
    assert warm.joined("127.0.0.1:1", {}) == "warm start: 2 warm workers ready on the head, 1 more starting"
    assert "runtime_env" in warm.joined("127.0.0.1:1", {"py_modules": ["x"]})
    assert warm.joined("10.0.0.1:6379", {}) is None  # another cluster: no pool to speak of
    on_head["ready"], on_head["importing"] = [], []
    assert warm.joined("127.0.0.1:1", {}).startswith("starting cold: no warm worker ready on the head (still importing")
    warmpool.write_status(head(), 0, 0, "the memory holds 0 of 7: 0.9 GiB available, each worker ~0.5 GiB")
    assert warm.joined("127.0.0.1:1", {}) == (
        "starting cold: no warm worker ready on the head (the memory holds 0 of 7: 0.9 GiB available, each worker "
        "~0.5 GiB)"
    )
    monkeypatch.setattr(local, "running", lambda: head(warm=0))
    assert warm.joined("127.0.0.1:1", {}) is None  # a head without `--warm`: as before, silent
    assert on_head["recycled"] == []


def test_workers_that_imported_older_code_are_recycled_before_the_run(on_head, monkeypatch):
    monkeypatch.setattr(local, "code_stamp", lambda: "edited")
    assert warm.joined("127.0.0.1:1", {}).startswith("starting cold: raylane's code changed")
    assert on_head["recycled"] == [11, 12]


def test_a_run_on_the_head_starts_its_refill_and_a_run_elsewhere_none(on_head):
    assert warm.refill() is False and on_head["spawned"] == 0  # no head joined
    warm.joined("127.0.0.1:1", {})
    assert warmpool.runs_starting() == [os.getpid()]  # the top-up waits for this run's start
    assert warm.refill() is True and on_head["spawned"] == 1
    assert warmpool.runs_starting() == []  # its end: the mark is gone


def test_the_top_up_asks_in_batches_of_half_the_cores_each_once_the_last_has_imported(on_head, monkeypatch):
    """Nothing about the machine's load: a shared head is never quiet (the pool used to wait for 3
    quiet seconds, and never filled). One at a time on 2 cores, 4 at a time on 8; never a batch
    while another still starts, imports, or has registered and not yet said so."""
    assert warmpool.top_up(head()) == 5  # 7 kept, 2 ready
    assert on_head["prestarted"] == [("127.0.0.1:3", 1)] * 5 and set(on_head["during"]) == {(0, 0, 0, 0)}
    assert len(on_head["ready"]) == 7 and warmpool.top_up(head()) == 0  # whole: nothing more
    assert warmpool.status(head()) == {**warmpool.status(head()), "ready": 7, "starting": 0, "why": None, "done": True}
    monkeypatch.setattr(warmpool.os, "cpu_count", lambda: 8)
    on_head["ready"], on_head["prestarted"] = [11, 12], []
    assert warmpool.top_up(head()) == 5 and on_head["prestarted"] == [("127.0.0.1:3", 4), ("127.0.0.1:3", 1)]
    monkeypatch.setattr(local, "code_stamp", lambda: "edited")  # raylane edited since they started
    assert warmpool.top_up(head()) == 7 and on_head["recorded"] == ["edited"] and 11 in on_head["recycled"]


def test_the_top_up_waits_only_while_a_raylane_run_on_the_head_is_starting(on_head, monkeypatch):
    looks = iter([[4321]] * 5 + [[]] * 100)
    monkeypatch.setattr(warmpool, "runs_starting", lambda: next(looks))
    asked_at: list[int] = []
    monkeypatch.setattr(raylet, "prestart", lambda raylet, num: asked_at.append(num) or on_head["ready"].append(99))
    warmpool.top_up(head(warm=3))
    assert asked_at == [1] and next(looks) == []  # asked once the run's start was over


def test_the_pool_fills_what_the_memory_holds_and_says_why(on_head, monkeypatch):
    from types import SimpleNamespace

    def memory():  # room for 2 more beside the 2 ready: each worker the pool gains takes its share
        pool = len(on_head["ready"]) + len(on_head["importing"]) + len(on_head["starting"])
        return SimpleNamespace(available=warmpool.SPARE_BYTES + (4.5 - pool) * warmpool.WORKER_BYTES)

    monkeypatch.setattr(warmpool.psutil, "virtual_memory", memory)
    assert warmpool.top_up(head()) == 2
    assert warmpool.status(head())["why"] == "the memory holds 4 of 7: 1.2 GiB available, each worker ~0.5 GiB"
    assert warmpool.describe(head(), started=False) == (
        "4 of 7 warm workers ready: the memory holds 4 of 7: 1.2 GiB available, each worker ~0.5 GiB"
    )


def test_the_top_up_stops_at_its_budget_and_says_how_far_it_got(on_head, monkeypatch):
    monkeypatch.setattr(raylet, "prestart", lambda raylet, num: None)  # workers that never come
    monkeypatch.setattr(warmpool, "POLL_S", 0.01)
    warmpool.top_up(head(), budget_s=0.2)
    assert warmpool.status(head())["why"] == "2 of 7 ready after 0.2 s; the next run's end asks again"
    assert warmpool.describe(head(), started=False).startswith("2 of 7 warm workers ready: 2 of 7 ready after 0.2 s")


def test_a_failed_import_stops_the_top_up_and_says_why(on_head, monkeypatch):
    monkeypatch.setattr(warmpool, "_marks", lambda pids: ["", "ModuleNotFoundError: No module named 'torch'"])
    assert warmpool.top_up(head()) == 0
    assert (
        warmpool.status(head())["why"]
        == "the warm workers' imports failed (ModuleNotFoundError: No module named 'torch')"
    )


def test_up_says_what_the_pool_really_has(on_head):
    assert (
        warmpool.describe(head(), started=True)
        == "7 warm workers starting (`raylane up` again says how many are ready)"
    )
    on_head["importing"], on_head["starting"] = [13], [14]
    assert warmpool.describe(head(), started=False) == "2 of 7 warm workers ready, 2 starting"
    assert warmpool.describe(head(warm=0), started=False) == "no warm workers"
    warmpool.write_status(head(pid=999), 0, 0, "another head's")
    assert warmpool.status(head()) == {}  # a record of a head that is gone says nothing of this one


def test_a_runs_starting_mark_lasts_while_its_driver_lives_and_its_start_may_last(monkeypatch, tmp_path):
    import subprocess
    import time

    monkeypatch.setenv("RAYLANE_HOME", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()
    for pid in (os.getpid(), gone.pid, os.getppid()):
        warmpool.mark_run(pid)
    old = tmp_path / "warm" / "runs" / str(os.getppid())
    os.utime(old, (time.time() - warmpool.RUN_STARTING_S - 1,) * 2)
    assert warmpool.runs_starting() == [os.getpid()]
    assert sorted(p.name for p in (tmp_path / "warm" / "runs").iterdir()) == [str(os.getpid())]


def test_the_summary_says_which_actors_were_warm():
    times = StartupTimes()
    times.unix.update(launch=100.0, ray_init=104.0)
    times.on_event(Startup(phases={}, processes={"controller": 90.0, "event sink": 99.0, "late": 102.0}))
    times.on_event(Startup(phases={}, processes={"rank 0": 101.0, "rank 1": 95.0}))
    times.on_event(Startup(phases={}, processes={"rank 1": 150.0}))  # a restart's: not start-up
    assert times.warm_actors() == {
        "controller": True,
        "event sink": True,
        "late": False,
        "rank 0": False,
        "rank 1": True,
    }


def test_the_heads_path_finds_this_installs_raylane_first(monkeypatch):
    """A job on a `raylane up` head runs `raylane train ...` in the head's environment: the head
    started from a shell without the venv activated still finds the raylane that started it."""
    import sys
    from pathlib import Path

    here = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", here, "/bin"]))
    assert local.head_path().split(os.pathsep) == [here, "/usr/bin", "/bin"]
    monkeypatch.setenv("PATH", "/usr/bin")
    assert local.head_path().split(os.pathsep) == [here, "/usr/bin"]
