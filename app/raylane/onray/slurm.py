"""Ray on a Slurm allocation: what scripts/slurm-ray.sbatch runs on each node, and how it waits
for the cluster. `python -m raylane.onray.slurm node --head ...` (or `--address HEAD:PORT`) runs
one Ray node in the foreground of its srun task; `python -m raylane.onray.slurm wait ...` returns
once the head answers and every node of the allocation has joined, asking Ray, or fails in one line.

Why a node of its own rather than a bare `ray start --block`: Slurm ends a job (`scancel`, a
node failure, the time limit without `--signal`) by sending SIGTERM to every process of every
step at once, then SIGKILL KillWait seconds later (30 by default). Ray's GCS and raylets exit on
that SIGTERM within a second, so the workers would die before they could checkpoint. Here Ray's
processes are started with SIGTERM blocked (a blocked signal stays pending; the mask is inherited
by every process Ray starts): the driver, which gets the same SIGTERM, has the ranks checkpoint at
one agreed step on a cluster that is still there, and the batch script then stops the nodes
(SIGUSR1, which srun forwards to its task). Nothing here outlives the job: Slurm's SIGKILL
reaches a node that was not stopped by then.

Internal: not raylane's public API (see raylane.__all__); it may change in any release."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from raylane.clusters.local import stop_session

# What Ray's processes must not act on: Slurm's SIGTERM to the whole job (see above), and the
# SIGUSR1 that stops a node, which srun forwards to every process of its step.
HELD = {signal.SIGTERM, signal.SIGUSR1}
STOP_GRACE_S = 2.0  # for Ray's processes to exit on SIGINT, before SIGKILL
PREFIX = "raylane slurm:"


def node_argv(args: argparse.Namespace, temp: str) -> list[str]:
    """`ray start --block` for this node: the head on `--port`, or a node joining `--address`,
    with the CPUs and GPUs Slurm gave this node and ports of its own for everything else. Ray's
    fixed defaults (dashboard 8265, agent 52365, client server 10001) would collide with another
    job's Ray on a shared node, or with a test's on this machine."""
    ray = str(Path(sys.executable).parent / "ray")
    argv = [ray, "start", "--block", f"--temp-dir={temp}", "--disable-usage-stats"]
    agent, dashboard, client = _free_ports(3)
    if args.head:
        argv += ["--head", f"--port={args.port}", f"--node-ip-address={args.ip}", "--dashboard-host=127.0.0.1"]
        argv += [f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}"]
    else:
        argv.append(f"--address={args.address}")
    argv += [f"--dashboard-agent-listen-port={agent}", f"--num-gpus={os.environ.get('SLURM_GPUS_ON_NODE', 0)}"]
    if cpus := os.environ.get("SLURM_CPUS_ON_NODE"):
        argv.append(f"--num-cpus={cpus}")
    return argv


def run_node(args: argparse.Namespace) -> int:
    """One Ray node until SIGUSR1 (the batch script's stop) or until `ray start` ends on its own;
    then every process of the node, by pid. Returns 0 when stopped, else `ray start`'s code."""
    import subprocess

    temp = tempfile.mkdtemp(prefix="raylane-slurm-", dir="/tmp")  # short: Ray's socket paths are limited
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)  # inherited by `ray start` and all it starts
    proc = subprocess.Popen(node_argv(args, temp), start_new_session=True, stdin=subprocess.DEVNULL)
    stopped = False
    try:
        while proc.poll() is None and not stopped:
            stopped = signal.sigtimedwait({signal.SIGUSR1}, 0.5) is not None
    finally:
        print(f"{PREFIX} stopping the Ray node on {socket.gethostname()}", flush=True)
        # SIGTERM is held in every process of the node: SIGINT (`ray start` stops what it
        # started; Ray's daemons exit), then SIGKILL for what is left.
        stop_session(proc.pid, first=(signal.SIGINT, STOP_GRACE_S))
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)
    return 0 if stopped else proc.returncode


def wait_for_nodes(
    address: str, nodes: int, timeout_s: float, hosts: list[str], tasks: dict[int, str] | None = None
) -> str | None:
    """Until the head at `address` answers and `nodes` Ray nodes are alive, asking Ray; the one
    line that says what is missing when `timeout_s` runs out first, else None. `tasks`: the srun
    task (pid -> host) of each node, whose end before the cluster is up ends the wait at once."""
    from raylane.clusters.addresses import split_host_port

    deadline = time.monotonic() + timeout_s
    host, port = split_host_port(address)
    while host is None or not _listening(host, port):
        if failed := _ended(tasks or {}):
            return failed
        if time.monotonic() > deadline:
            return f"{PREFIX} the Ray head at {address} did not start within {timeout_s:g} s (its srun output is above)"
        time.sleep(0.5)
    import ray

    from raylane.config import ConfigError
    from raylane.onray.cluster import join

    try:
        join(address, logging_level=logging.ERROR, log_to_driver=False)  # one line, not Ray's warnings
    except ConfigError as exc:
        return f"{PREFIX} {exc}"
    alive: list[dict] = []
    while True:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) >= nodes:
            ray.shutdown()
            return None
        if failed := _ended(tasks or {}):
            ray.shutdown()
            return failed
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ray.shutdown()
    seen = {str(n.get("NodeManagerHostname", "")).split(".")[0] for n in alive}
    absent = [h for h in hosts if h.split(".")[0] not in seen]
    return f"{PREFIX} {len(alive)} of {nodes} Ray nodes joined the head at {address} within {timeout_s:g} s" + (
        f" (not joined: {', '.join(absent)})" if absent and len(absent) == nodes - len(alive) else ""
    )


def _ended(tasks: dict[int, str]) -> str | None:
    """The line for a node whose srun task has ended (its Ray failed to start), else None."""
    for pid, host in tasks.items():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("Z", "gone"):
            return f"{PREFIX} the Ray node on {host} ended before the cluster was up (its srun output is above)"
    return None


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _free_ports(n: int) -> list[int]:
    """`n` distinct free ports: each socket stays bound until all are picked (one at a time, the
    system may hand out a port it just gave back)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raylane.onray.slurm", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    node = verbs.add_parser("node", help="run one Ray node until SIGUSR1")
    where = node.add_mutually_exclusive_group(required=True)
    where.add_argument("--head", action="store_true", help="the head (GCS) on --ip:--port")
    where.add_argument("--address", help="the head's HOST:PORT, to join")
    node.add_argument("--ip", help="the head's address on the network the nodes share")
    node.add_argument("--port", type=int, default=6379)
    wait = verbs.add_parser("wait", help="until the head answers and --nodes nodes joined")
    wait.add_argument("--address", required=True)
    wait.add_argument("--nodes", type=int, required=True)
    wait.add_argument("--timeout", type=float, required=True, help="seconds, for the head and every node")
    wait.add_argument("--hosts", nargs="*", default=[], help="the allocation's node names, to name the missing")
    wait.add_argument("--tasks", nargs="*", type=int, default=[], help="each host's srun pid, in --hosts order")
    args = parser.parse_args(argv)
    if args.verb == "node":
        if args.head and not args.ip:
            parser.error("--head needs --ip")
        return run_node(args)
    start = time.monotonic()
    failed = wait_for_nodes(
        args.address, args.nodes, args.timeout, args.hosts, dict(zip(args.tasks, args.hosts, strict=False))
    )
    if failed:
        print(failed, file=sys.stderr, flush=True)
        return 1
    print(f"{PREFIX} {args.nodes} Ray node(s) up at {args.address} after {time.monotonic() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
