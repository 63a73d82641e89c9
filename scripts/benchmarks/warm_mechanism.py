"""Experiments E1 and E2 of issue 52 (the study: warm-start-notes.md, section 5), no raylane change.

E1: on a Ray head started with worker prestart and a preload list, does a prestarted, preloaded
worker host a new job's actor with an empty runtime_env (and not one with env_vars)? Does a second
driver still find warm workers, or does nothing refill the pool?
E2: the raylet's PrestartWorkers gRPC refills the pool (token auth on): its delay, its CPU cost per
worker, and an idle warm worker's memory.

    PYTHONPATH=$PWD/app python scripts/benchmarks/warm_mechanism.py [--repeats 5] [--json out.json]

The head is raylane's own `raylane up` (raylane.clusters.local.up) on a RAYLANE_HOME of its own,
with the prestart variables in its environment; it is stopped by its session at the end."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRELOAD = "torch,torch.distributed,torch._dynamo,ray.train.torch"
POOL_ENV = {
    "RAY_enable_worker_prestart": "1",
    "RAY_preload_python_modules": PRELOAD,
    "RAY_num_workers_soft_limit": "8",
}
SETTLE_S = 1.0  # refilled workers are ready once they used under QUIET_CPU_S of CPU for this long
QUIET_CPU_S = 0.1
READY_TIMEOUT_S = 180.0
TICK = os.sysconf("SC_CLK_TCK")


# -- what a driver runs (a subprocess: each driver is a job of its own) ---------------------------


def _probe_class():
    import ray

    @ray.remote
    class Probe:
        def info(self) -> dict:
            import os
            import sys

            with open("/proc/self/stat") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            with open("/proc/uptime") as f:
                uptime = float(f.read().split()[0])
            return {
                "pid": os.getpid(),
                "start_unix": time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK"),
                "dynamo": "torch._dynamo" in sys.modules,
                "torch": "torch" in sys.modules,
                # Ray sets OMP_NUM_THREADS (to the actor's CPUs) as a task starts: a process that
                # imported torch before may keep another thread count.
                "omp_env": os.environ.get("OMP_NUM_THREADS"),
                "torch_threads": sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None,
                "cuda_initialized": sys.modules["torch"].cuda.is_initialized() if "torch" in sys.modules else None,
            }

    return Probe


def driver(address: str, refill: int, probes: bool = True) -> dict:
    """One job: four actors (no runtime_env; {}; env_vars {}; env_vars X=1), each timed from .remote()
    to its first answer and said warm when its process started before this driver did."""
    import ray

    began = time.time()
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    probe = _probe_class()
    out = {}
    cases = (
        ("none", {}),
        ("empty_dict", {"runtime_env": {}}),
        ("env_vars_empty", {"runtime_env": {"env_vars": {}}}),
        ("env_vars_X", {"runtime_env": {"env_vars": {"X": "1"}}}),
    )
    for name, options in cases if probes else ():
        options = {"num_cpus": 1, **options}  # as a rank asks
        t0 = time.time()
        actor = probe.options(**options).remote()
        info = ray.get(actor.info.remote(), timeout=READY_TIMEOUT_S)
        info["ready_s"] = round(time.time() - t0, 3)
        info["warm"] = info["start_unix"] < began
        out[name] = info
        ray.kill(actor)
    if refill:
        t0 = time.time()
        prestart(refill)
        out["refill_call_s"] = round(time.time() - t0, 3)
    ray.shutdown()
    return out


def prestart(num: int, keep_alive_s: int = 600) -> None:
    """The raylet's PrestartWorkers: `num` job-less Python workers with an empty runtime_env, kept
    from the idle killer for `keep_alive_s`. The token interceptor: the head has token auth on."""
    import grpc
    import ray
    from ray._private.authentication.grpc_authentication_client_interceptor import (
        SyncAuthenticationMetadataClientInterceptor,
    )
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc

    node = next(n for n in ray.nodes() if n["Alive"])
    channel = grpc.intercept_channel(
        grpc.insecure_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"),
        SyncAuthenticationMetadataClientInterceptor(),
    )
    with channel:
        stub = node_manager_pb2_grpc.NodeManagerServiceStub(channel)
        request = node_manager_pb2.PrestartWorkersRequest(
            language=common_pb2.PYTHON, num_workers=num, keep_alive_duration_secs=keep_alive_s
        )
        stub.PrestartWorkers(request, timeout=10)


# -- the orchestrator: the head, the drivers, /proc ------------------------------------------------


def refill(cluster, num: int) -> int:
    """`num` more job-less workers through the raylet's PrestartWorkers, in the batches it takes
    (raylane.onray.warmpool.top_up: at most min(cores, CPUs) starting at once)."""
    import dataclasses

    from raylane.clusters.local import code_stamp
    from raylane.onray.warmpool import idle_workers as pool

    target = len(pool(cluster.pid, starting=True)) + num
    return top_up(dataclasses.replace(cluster, warm=target, code=code_stamp()))


def top_up(head) -> int:
    from raylane.onray.warmpool import top_up as raylanes

    return raylanes(head)


def session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (the head's: `raylane up` starts it in one of its own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split() if entry.name.isdigit() else []
        except OSError:
            continue
        if fields and int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def idle_workers(sid: int) -> dict[int, dict]:
    """The head's idle Python workers (title `ray::IDLE`): pid -> CPU seconds, RSS and PSS (MB)."""
    found = {}
    for pid in session_pids(sid):
        try:
            if not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::IDLE"):
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        kb = {line.split(":")[0]: int(line.split()[1]) for line in rollup[1:] if line.split()[-1] == "kB"}
        found[pid] = {
            "cpu_s": (int(fields[11]) + int(fields[12])) / TICK,
            "rss_mb": kb.get("Rss", 0) / 1024,
            "pss_mb": kb.get("Pss", 0) / 1024,
        }
    return found


def wait_settled(sid: int, before: set[int], expected: int) -> tuple[float, dict[int, dict]]:
    """Until `expected` new idle workers exist and together used under QUIET_CPU_S of CPU for
    SETTLE_S (an idle worker's threads use a little; an importing one a whole core): (seconds from
    the call until the window began, the new workers)."""
    t0 = time.monotonic()
    mark, ref = t0, None
    while time.monotonic() - t0 < READY_TIMEOUT_S:
        new = {p: v for p, v in idle_workers(sid).items() if p not in before}
        now = (set(new), sum(v["cpu_s"] for v in new.values()))
        if ref is None or now[0] != ref[0] or now[1] - ref[1] > QUIET_CPU_S:
            mark, ref = time.monotonic(), now
        elif len(new) >= expected and time.monotonic() - mark >= SETTLE_S:
            return mark - t0, new
        time.sleep(0.1)
    raise TimeoutError(f"{expected} refilled workers did not settle in {READY_TIMEOUT_S:g} s")


def run_driver(address: str, env: dict, refill: int = 0, probes: bool = True) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--driver", address, "--refill", str(refill), *([] if probes else ["--no-probes"])],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}] (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--driver")
    parser.add_argument("--refill", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-cpus", type=int, default=4)
    parser.add_argument("--json")
    parser.add_argument("--no-probes", action="store_true")
    parser.add_argument(
        "--api-only",
        action="store_true",
        help="no RAY_enable_worker_prestart: the pool is only what PrestartWorkers starts (raylane's design)",
    )
    args = parser.parse_args()
    if args.driver:
        print(json.dumps(driver(args.driver, args.refill, not args.no_probes)))
        return
    home = tempfile.mkdtemp(prefix="wt52-e1-")
    pool_env = {**POOL_ENV, "RAY_enable_worker_prestart": "0" if args.api_only else "1"}
    if args.api_only:
        pool_env["RAY_prestart_worker_first_driver"] = "0"
    os.environ.update({"RAYLANE_HOME": home, **pool_env})
    from raylane.clusters import local

    report: dict = {"load_before": os.getloadavg(), "env": pool_env, "num_cpus": args.num_cpus}
    cluster, _ = local.up(args.num_cpus, warm=0)  # warm=0: this script's own settings, not raylane's
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    try:
        t0 = time.monotonic()
        if args.api_only:
            refill(cluster, args.num_cpus)
        delay, first = wait_settled(cluster.pid, set(), args.num_cpus if args.api_only else 1)
        report["pool_at_start"] = {
            "n": len(first),
            "ready_s": round(delay, 2),
            "waited_s": round(time.monotonic() - t0, 2),
        }
        # E1: drivers one after another until the pool is spent, no refill.
        drivers = []
        for _ in range(args.num_cpus + 1):
            drivers.append({"idle_before": len(idle_workers(cluster.pid)), **run_driver(cluster.address, env)})
            time.sleep(2)  # the job's own workers exit with it
        report["e1_drivers"] = drivers
        # E2: refill through PrestartWorkers, repeated; the cost of each new worker.
        refills = []
        for _ in range(args.repeats):
            before = set(idle_workers(cluster.pid))
            t0 = time.monotonic()
            asked = refill(cluster, 5)
            called = time.monotonic() - t0
            delay, new = wait_settled(cluster.pid, before, 5)
            refills.append(
                {
                    "asked": asked,
                    "batches_s": round(called, 2),
                    "ready_s": round(called + delay, 2),
                    "cpu_s": [round(v["cpu_s"], 2) for v in new.values()],
                    "rss_mb": [round(v["rss_mb"]) for v in new.values()],
                    "pss_mb": [round(v["pss_mb"]) for v in new.values()],
                    "next_driver": run_driver(cluster.address, env),
                    "load": os.getloadavg(),
                }
            )
        report["e2_refills"] = refills
        report["idle_after"] = len(idle_workers(cluster.pid))
    finally:
        local.down()
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    cpu = [c for r in refills for c in r["cpu_s"]]
    print("refill CPU s per worker:", summary(cpu))
    print("refill ready s:", summary([r["ready_s"] for r in refills]))
    print("idle warm worker RSS MB:", summary([m for r in refills for m in r["rss_mb"]]))
    print("idle warm worker PSS MB:", summary([m for r in refills for m in r["pss_mb"]]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
