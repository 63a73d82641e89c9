"""Warm workers (issue 52; raylane.onray.warm): what decides that a run's actors get an empty
runtime_env, the head's settings, the start-up line's reasons, stale code and the refill. All
in-process; a warm run end to end is tests/e2e/test_warm.py (slow)."""

from __future__ import annotations

import inspect
import os

import pytest

from raylane.clusters import local
from raylane.loop.events import Startup
from raylane.loop.startup import StartupTimes
from raylane.onray import internals, warm
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


def test_only_a_job_less_worker_imports_the_warm_modules(monkeypatch):
    """Ray's preload runs in every Python worker the head starts: the pool's own (job-less)
    import torch and the loop; one started for a job's actor (a sweep's trial, Ray Train's sync
    actor, Ray Data's) imports nothing it would not have, and outside a worker nothing happens."""
    import importlib
    from types import SimpleNamespace

    import ray

    from raylane.onray import preload

    imported: list[str] = []
    monkeypatch.setattr(importlib, "import_module", imported.append)
    importlib.reload(preload)  # this process is no Ray worker
    assert imported == []
    for job, expected in ((ray.JobID.nil().hex(), list(local.WARM_PRELOAD)), ("01000000", [])):
        context = SimpleNamespace(get_job_id=lambda job=job: job)
        monkeypatch.setattr(ray, "get_runtime_context", lambda context=context: context)
        imported.clear()
        importlib.reload(preload)
        assert imported == expected, job


def test_a_record_of_an_older_head_reads_as_one_without_warm_workers():
    record = {k: v for k, v in vars(head()).items() if k not in ("warm", "env", "code")}
    assert local.LocalCluster(**record).warm == 0


def test_the_code_stamp_changes_when_raylanes_code_does(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    before = local.code_stamp(tmp_path)
    os.utime(tmp_path / "a.py", ns=(1, 10**18))
    assert local.code_stamp(tmp_path) != before


@pytest.fixture
def on_head(monkeypatch):
    """A `raylane up` head at 127.0.0.1:1 with idle workers 11 and 12, the code it started with;
    each PrestartWorkers call adds that many idle workers."""
    seen = {"idle": [11, 12], "recycled": [], "prestarted": [], "recorded": [], "spawned": 0}

    def prestart(raylet, num):
        seen["prestarted"].append((raylet, num))
        seen["idle"] += range(100 + len(seen["idle"]), 100 + len(seen["idle"]) + num)

    def recycle(sid, pids):
        seen["recycled"].extend(pids)
        seen["idle"] = [p for p in seen["idle"] if p not in pids]

    monkeypatch.setattr(local, "running", lambda: head())
    monkeypatch.setattr(local, "code_stamp", lambda: "stamp")
    monkeypatch.setattr(local, "record_code", seen["recorded"].append)
    monkeypatch.setattr(warm, "idle_workers", lambda sid, starting=False: list(seen["idle"]))
    monkeypatch.setattr(warm, "recycle", recycle)
    monkeypatch.setattr(warm, "prestart", prestart)
    monkeypatch.setattr(warm, "spawn_top_up", lambda: seen.__setitem__("spawned", seen["spawned"] + 1) or True)
    monkeypatch.setattr(warm, "BATCH_SETTLE_S", 0)
    monkeypatch.setattr(warm, "POLL_S", 0)
    monkeypatch.setattr(warm, "QUIET_S", 0)
    monkeypatch.setattr(warm, "_busy", lambda sid, pool: False)
    monkeypatch.setattr(warm, "_joined", None)
    return seen


def test_the_start_up_line_says_warm_or_why_cold(on_head, monkeypatch):
    assert warm.joined("127.0.0.1:1", {}) == "warm start: 2 idle warm workers on the head"
    assert "runtime_env" in warm.joined("127.0.0.1:1", {"py_modules": ["x"]})
    assert warm.joined("10.0.0.1:6379", {}) is None  # another cluster: no pool to speak of
    on_head["idle"] = []
    assert "no idle warm worker" in warm.joined("127.0.0.1:1", {})
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
    assert warm.refill() is True and on_head["spawned"] == 1


def test_the_top_up_asks_in_batches_the_raylet_takes_up_to_the_pools_size(on_head, monkeypatch):
    monkeypatch.setattr(warm.os, "cpu_count", lambda: 2)  # the raylet starts 2 at a time here
    assert warm.top_up(head()) == 5  # 7 kept, 2 idle
    assert on_head["prestarted"] == [("127.0.0.1:3", 2), ("127.0.0.1:3", 2), ("127.0.0.1:3", 1)]
    assert len(on_head["idle"]) == 7 and warm.top_up(head()) == 0  # whole: nothing more
    monkeypatch.setattr(local, "code_stamp", lambda: "edited")  # raylane edited since they started
    assert warm.top_up(head()) == 7 and on_head["recorded"] == ["edited"] and 11 in on_head["recycled"]


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
