"""Ray on a Slurm allocation: what scripts/slurm-ray.sbatch runs on each node, and how it waits
for the cluster. `python -m raylane.onray.slurm node --head ...` (or `--address HEAD:PORT`) runs
one Ray node in the foreground of its srun task; `python -m raylane.onray.slurm wait ...` returns
once the head answers and every node of the allocation has joined, asking the head's GCS, or fails
in one line naming the Slurm nodes that did not; `... preflight` checks the script's settings
first (raylane.clusters.slurm).

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

from raylane.clusters.local import session_pids, stop_session
from raylane.clusters.slurm import NODE_LABEL, PREFIX, check_settings
from raylane.config import ConfigError

# What Ray's processes must not act on: Slurm's SIGTERM to the whole job (see above), and the
# SIGUSR1 that stops a node, which srun forwards to every process of its step.
HELD = {signal.SIGTERM, signal.SIGUSR1}
STOP_GRACE_S = 2.0  # for Ray's processes to exit on SIGINT, before SIGKILL
ASK_S = 5.0  # one question to the head's GCS (it answers in milliseconds when up)
NODE_CHECK_S = 2.0  # how often a node looks for its raylet


def node_argv(args: argparse.Namespace, temp: str) -> list[str]:
    """`ray start` for this node (run_node watches it): the head on `--port`, or a node joining `--address`,
    with the CPUs and GPUs Slurm gave this node and ports of its own for everything else. Ray's
    fixed defaults (dashboard 8265, agent 52365) would collide with another job's Ray on a shared
    node, or with a test's on this machine."""
    ray = str(Path(sys.executable).parent / "ray")
    argv = [ray, "start", f"--temp-dir={temp}", "--disable-usage-stats"]
    agent, dashboard, client = _free_ports(3)
    if args.head:
        argv += ["--head", f"--port={args.port}", f"--node-ip-address={args.ip}", "--dashboard-host=127.0.0.1"]
        argv += [f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}"]
    else:
        argv.append(f"--address={args.address}")
    argv += [f"--dashboard-agent-listen-port={agent}", f"--num-gpus={os.environ.get('SLURM_GPUS_ON_NODE', 0)}"]
    if cpus := os.environ.get("SLURM_CPUS_ON_NODE"):
        argv.append(f"--num-cpus={cpus}")
    if name := os.environ.get("SLURMD_NODENAME"):  # Slurm's name for this node: the wait names it
        argv.append(f"--labels={NODE_LABEL}={name}")
    return argv


def run_node(args: argparse.Namespace) -> int:
    """One Ray node until SIGUSR1 (the batch script's stop) or until the node's raylet is gone
    (`ray start` failed, or the node died); then every process of the node, by pid. Returns 0
    when stopped, else `ray start`'s code (1 where it had succeeded).

    `ray start` without --block, and the node watched here by its raylet, because on a loaded node
    Ray's own start-up limits ended heads that would have come up: with --block, `ray start` ends
    the whole node as soon as any of its processes exits, and the head's Ray Client server (which
    raylane never uses, and which `ray start` cannot leave out) exits when the head's node has not
    registered within 30 s of its own start; and `ray start` itself gives up on a raylet that has
    not registered 30 s after it started it, though the raylet goes on. Here the one bound is the
    batch script's wait for the nodes (RAYLANE_NODES_TIMEOUT_S)."""
    import subprocess

    host = socket.gethostname()
    temp = tempfile.mkdtemp(prefix="raylane-slurm-", dir="/tmp")  # short: Ray's socket paths are limited
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD)  # inherited by `ray start` and all it starts
    proc = subprocess.Popen(node_argv(args, temp), start_new_session=True, stdin=subprocess.DEVNULL)
    stopped, code, looked = False, None, 0.0
    try:
        while not stopped:
            stopped = signal.sigtimedwait({signal.SIGUSR1}, 0.5) is not None
            ended = code is None and proc.poll() is not None
            if ended:
                code = proc.returncode
            if stopped or code is None or (not ended and time.monotonic() - looked < NODE_CHECK_S):
                continue
            looked = time.monotonic()
            if not _raylet_alive(proc.pid):
                if code == 0:
                    print(f"{PREFIX} the Ray node on {host} died (its raylet exited)", flush=True)
                break
            if ended and code != 0:
                print(f"{PREFIX} `ray start` gave up on the node on {host}, whose raylet still starts", flush=True)
    finally:
        print(f"{PREFIX} stopping the Ray node on {host}", flush=True)
        # SIGTERM is held in every process of the node: SIGINT, then SIGKILL for what is left.
        stop_session(proc.pid, first=(signal.SIGINT, STOP_GRACE_S))
        proc.wait()
        shutil.rmtree(temp, ignore_errors=True)
    return 0 if stopped else (code or 1)


def _raylet_alive(sid: int) -> bool:
    """Whether session `sid` (a node's: `ray start` and all it started) still has its raylet."""
    import psutil

    for pid in session_pids(sid):
        try:
            if psutil.Process(pid).name() == "raylet":
                return True
        except psutil.Error:
            continue
    return False


def wait_for_nodes(
    address: str, nodes: int, timeout_s: float, hosts: list[str], tasks: dict[int, str] | None = None
) -> str | None:
    """Until the head at `address` answers and `nodes` Ray nodes are alive, asking the head's GCS;
    the one line that says what is missing when `timeout_s` runs out first, else None. `hosts`:
    the allocation's Slurm nodes, the head's first; `tasks`: the srun task (pid -> host) of each
    node, whose end before the cluster is up ends the wait at once.

    One bound for all of it: a head slow to start (its raylet registers only once its dashboard
    is up, 25-60 s on a loaded node) is waited for as long as a node slow to join. Nothing here
    joins as a driver: ray.init would need this host's raylet up, and gives up on its own."""
    from raylane.clusters.addresses import listening, split_host_port
    from raylane.onray.cluster import gcs_answers
    from raylane.onray.internals import GcsClient  # Ray's import (seconds on a busy node): before the bound

    deadline = time.monotonic() + timeout_s
    where = f"on {hosts[0]} ({address})" if hosts else f"at {address}"
    bound = f"within {timeout_s:g} s (RAYLANE_NODES_TIMEOUT_S)"
    host, port = split_host_port(address)
    # The port first (a refused connect costs nothing), then gRPC, as the GCS speaks it.
    while host is None or not (listening(host, port) and gcs_answers(address, _left(deadline, 2.0))):
        if failed := _ended(tasks or {}):
            return failed
        if time.monotonic() > deadline:
            return f"{PREFIX} the Ray head {where} did not start {bound}; its srun output is above"
        time.sleep(0.5)
    gcs, alive = GcsClient(address=address), []
    while True:
        try:
            alive = [n for n in gcs.get_all_node_info(timeout=_left(deadline, ASK_S)).values() if _alive(n)]
        except Exception as exc:  # noqa: BLE001 - a GCS busy starting: asked again until the bound
            logging.getLogger("raylane").debug("the head's GCS did not answer: %s", exc)
        if len(alive) >= nodes:
            return None
        if failed := _ended(tasks or {}):
            return failed
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    absent = not_joined(hosts, alive)
    named = f"; not joined: {', '.join(absent)}" if absent and len(absent) == nodes - len(alive) else ""
    return f"{PREFIX} {len(alive)} of {nodes} Ray nodes up, the head {where}, {bound}{named}"


def not_joined(hosts: list[str], alive: list) -> list[str]:
    """Those of the Slurm nodes `hosts` that no alive Ray node (GcsNodeInfo) stands for: by the
    Slurm name each node's Ray carries (NODE_LABEL), else by its short hostname."""
    seen = set()
    for node in alive:
        seen.add(node.labels.get(NODE_LABEL) or str(node.node_manager_hostname).split(".")[0])
    return [h for h in hosts if h not in seen and h.split(".")[0] not in seen]


def _alive(node) -> bool:
    state = node.DESCRIPTOR.fields_by_name["state"].enum_type.values_by_number[node.state].name
    return state == "ALIVE"


def _left(deadline: float, most: float) -> float:
    """Seconds for one question: at most `most`, at least a little, never far past `deadline`."""
    return max(0.5, min(most, deadline - time.monotonic()))


def _ended(tasks: dict[int, str]) -> str | None:
    """The line for a node whose srun task has ended (its Ray failed to start), else None. The
    batch script reaps its srun tasks only after this wait: an ended one is a zombie till then."""
    import psutil

    for pid, host in tasks.items():
        try:
            ended = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            ended = True
        except psutil.Error:  # another user's, say: not known to have ended
            ended = False
        if ended:
            return f"{PREFIX} the Ray node on {host} ended before the cluster was up (its srun output is above)"
    return None


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
    verbs.add_parser("preflight", help="check the batch script's settings (RAYLANE_RAY_PORT, the waits)")
    args = parser.parse_args(argv)
    if args.verb == "preflight":
        try:
            check_settings(os.environ)
        except ConfigError as exc:
            print(f"{PREFIX} {exc}", file=sys.stderr, flush=True)
            return 2
        return 0
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
