"""A many-node soak (issue 63, §3) on Ray's fake multi-node cluster (ray.cluster_utils): one raylet
per node on this machine, each named by RAYLANE_NODE_NAME in its raylet's environment (as each
host's name would differ; the workers a raylet starts inherit it), and a head with no CPU for the
driver. A tiny model's run with a straggler, a node drained (`ray drain-node`, Ray's own notice)
and a hang, each named with its node on the terminal, in the summary and in MLflow; the workers
placed as `scaling.placement_strategy: SPREAD` asks (each worker's node found from its raylet, as
tests/e2e/test_ft_drain.py does), before the drain and after it, without the drained node.

The nodes have 4 CPUs each for 2 workers each: the CPUs leave room for PACK's 4 a node, so an
even spread is the strategy's doing, and the group fits on the nodes left after a drain.

The shortest, make test's: 2 nodes and 4 workers, one launch with a straggler (its hang is in-process there);
4 nodes and 8 workers in two launches (failure.max_failures 0: the drain ends the first
KILLED, naming the node; the relaunch resumes on the 3 nodes left and hangs), and 8 nodes and 16
workers in one launch that restarts (failure.max_failures 1: the group hands over
without the drained node, then hangs, is restarted once, hangs again and fails)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from raylane.loop.observe import faults
from tests.conftest import REPO, cli_env, read_json, wait_for

pytestmark = [pytest.mark.ray]

HELPER = REPO / "tests" / "helpers" / "soak_pipe.py"
CPUS_PER_NODE = 4
STRAGGLER_MS = 500
HANG_LINE = next(i for i, x in enumerate(Path(faults.__file__).read_text().splitlines(), 1) if "time.sleep(3600)" in x)


class PeakMemory:
    """The summed RSS of this process's descendants (the cluster's GCS, raylets and workers, the
    driver), sampled every second on a thread; `peak_gib` the highest. Shared pages (torch's
    libraries in every worker) count once per process: an upper bound."""

    def __init__(self) -> None:
        self.peak_gib, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(1.0):
            total = 0
            for p in me.children(recursive=True):
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_gib = max(self.peak_gib, total / 2**30)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return self.peak_gib


class Nodes:
    """A fake cluster: a head with no CPU (the driver's node), `count` nodes of CPUS_PER_NODE named
    node-0..; stopped by `shutdown` (every process it started, by its own handles)."""

    def __init__(self, count: int) -> None:
        from ray.cluster_utils import Cluster

        self.temp = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # short: Ray's socket paths are limited
        common = {"num_gpus": 0, "temp_dir": self.temp}
        head = {"num_cpus": 0, "include_dashboard": False, "env_vars": {"RAYLANE_NODE_NAME": "head"}, **common}
        self.cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
        self.named = {}
        try:
            for i in range(count):
                name = f"node-{i}"
                env = {"RAYLANE_NODE_NAME": name}
                self.named[name] = self.cluster.add_node(num_cpus=CPUS_PER_NODE, env_vars=env, **common)
            self.cluster.wait_for_nodes(timeout=120)
        except BaseException:
            self.shutdown()  # the nodes started so far
            raise
        self.address = self.cluster.address

    def node_of(self, pid: int) -> str | None:
        """The node whose raylet started process `pid` (None: gone already)."""
        try:
            ancestors = {p.pid for p in psutil.Process(pid).parents()}
        except psutil.NoSuchProcess:
            return None
        found = [name for name, n in self.named.items() if n.all_processes["raylet"][0].process.pid in ancestors]
        return found[0] if len(found) == 1 else None

    def drain(self, name: str) -> None:
        """Ray's preemption notice to node `name`, as a cloud's spot notice reaches Ray."""
        drain = [sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", self.address]
        drain += ["--node-id", self.named[name].node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION"]
        drain += ["--reason-message", "spot reclaim", "--deadline-remaining-seconds", "300"]
        subprocess.run(drain, check=True, capture_output=True, timeout=60)

    def shutdown(self) -> None:
        self.cluster.shutdown()
        shutil.rmtree(self.temp, ignore_errors=True)


def _records(seen: Path) -> dict[int, list[dict]]:
    """Each rank's steps as soak_pipe recorded them (a line being written is left out)."""
    out = {}
    for path in seen.glob("rank*.jsonl"):
        out[int(path.stem[4:])] = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    return out


def _group(seen: Path, workers: int, step: int, old: set[int]) -> dict[int, int]:
    """rank -> pid of a group that started after the processes `old`, once each of its ranks has
    recorded a step at or past `step`."""

    def new() -> dict[int, int] | None:
        latest = {r: lines[-1] for r, lines in _records(seen).items() if lines and lines[-1]["pid"] not in old}
        ready = len(latest) == workers and all(x["step"] >= step for x in latest.values())
        return {r: x["pid"] for r, x in latest.items()} if ready else None

    return wait_for(new, timeout_s=600, interval_s=0.2)


def _placed(nodes: Nodes, group: dict[int, int]) -> dict[int, str]:
    """rank -> the node its process runs on, from its raylet; each process's RAYLANE_NODE_NAME agrees."""
    where = {rank: nodes.node_of(pid) for rank, pid in group.items()}
    assert None not in where.values(), where
    return where


def _spread(where: dict[int, str], over: list[str]) -> None:
    """SPREAD's placement: every node of `over` holds a worker and none of the others does, as
    evenly as the count allows."""
    counts = Counter(where.values())
    assert set(counts) == set(over), (counts, over)
    assert max(counts.values()) - min(counts.values()) <= 1, counts


def _project(tmp_path: Path, workers: int, max_failures: int, timeout_s: int = 15, steps: int = 400) -> Path:
    shutil.copy(HELPER, tmp_path / "pipe.py")
    seen = tmp_path / "seen"
    seen.mkdir()
    (tmp_path / "run.yaml").write_text(
        "pipeline: ./pipe.py\n"
        f"scaling: {{num_workers: {workers}, placement_strategy: SPREAD}}\n"
        f"train: {{max_steps: {steps}, batch_size: 4, seed: 0}}\n"
        f"failure: {{max_failures: {max_failures}}}\n"
        "checkpoint: {every_n_steps: 0, every_n_epochs: 0}\n"
        f"dist: {{timeout_s: {timeout_s}}}\n"
        "stragglers: {windows: 2}\n"
        "mlflow: {log_every_n_steps: 5, log_model: false, system_metrics: false}\n"
        f"run: {{name: soak, storage_path: {tmp_path / 'runs'}}}\n"
        f"env: {{SOAK_RECORD: {seen}}}\n"  # the workers' environment: the driver's is not theirs
    )
    return seen


def _hung_line(rank: int, node: str) -> str:
    return f"never reached it: rank {rank} on {node} at {faults.__file__}:{HANG_LINE} in before_step"


def _straggler_named(p, rank: int, node: str) -> str:
    def named() -> str | None:
        return next((x for x in p.output.splitlines() if "straggler: rank" in x), None)

    wait_for(lambda: named() or p.proc.poll() is not None, timeout_s=300)
    line = named()
    assert line is not None, p.output  # the run ended with no straggler named
    assert f"straggler: rank {rank} on {node} takes " in line and "its own compute is slow" in line, line
    return line


def _report(name: str, started: float, memory: PeakMemory, *outputs: str) -> None:
    print(f"\n{name}: {time.monotonic() - started:.0f} s, peak RSS {memory.stop():.2f} GiB")
    for out in outputs:
        print("\n".join(x for x in out.splitlines() if x.startswith(("[raylane]", "run ", "  error"))))


# Slow (~70-90 s, a 2-node cluster of its own): make test names a straggler in-process
# (tests/unit/test_step_times.py, test_driver_scale.py) and a hung rank with its node
# (tests/unit/test_fault_nodes.py); the 4- and 8-node soaks below are slow too.
@pytest.mark.slow
def test_on_2_nodes_a_straggler_is_named_with_its_node(run_cli, tmp_path):
    """The shortest soak: 4 workers on 2 nodes, SPREAD: 2 a node. Rank 3 is slow
    (0.5 s a step): the straggler line names it and its node (at step 15, its second window), as
    does its MLflow tag, and the run ends FINISHED at step 20. (With 2 workers no straggler can be
    named: the other rank's step waits on the slow one's. A hang and a drained node, each named
    with its node: the 4- and 8-node soaks below, slow; in make test, in-process,
    tests/unit/test_fault_nodes.py. The hang was here too until make test's 15 minutes ran out:
    it cost ~25 s of the ~95.)"""
    workers, straggler = 4, 3
    seen = _project(tmp_path, workers, max_failures=0, timeout_s=10, steps=20)
    memory, started, launched = PeakMemory(), time.monotonic(), []
    nodes = Nodes(2)
    try:
        env = cli_env(tmp_path, RAYLANE_FAULTS=f"slow@rank={straggler},ms={STRAGGLER_MS}")
        launched.append(
            p := run_cli("train", "run.yaml", "--address", nodes.address, "--summary-json", "s.json", env=env)
        )
        where = _placed(nodes, _group(seen, workers, 1, set()))
        _spread(where, list(nodes.named))
        line = _straggler_named(p, straggler, where[straggler])
        assert p.wait(300) == 0, p.output
    finally:
        nodes.shutdown()
        _report("2 nodes, 4 workers", started, memory, *(x.output for x in launched))
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["steps"] == 20, s
    tags = MlflowClient(s["tracking_uri"]).get_run(s["run_id"]).data.tags
    assert tags[f"raylane.straggler.rank{straggler}"] == line.removeprefix("[raylane] "), tags
    assert [(x["rank"], x.get("node")) for x in s["stragglers"]] == [(straggler, where[straggler])], s["stragglers"]


@pytest.mark.slow  # 6-8 minutes on 2 cores: a fake cluster of 4 nodes, 8 workers started twice
def test_on_4_nodes_a_straggler_a_drained_node_and_a_hang_are_each_named_with_their_node(run_cli, tmp_path):
    """8 workers on 4 nodes, SPREAD: 2 a node. Rank 5 is slow (its compute, 0.5 s a step): the
    straggler line names it and its node. Ray's drain notice to a node that holds neither rank 5
    nor rank 7: at failure.max_failures 0 every rank checkpoints at one step and the run ends
    KILLED, the summary naming the node. The relaunch resumes there on the 3 nodes left (none on
    the drained one, SPREAD: 3, 3, 2) and rank 7 hangs 3 steps later: the run fails past
    dist.timeout_s with the one line naming rank 7, its node and where it stood; its stack is
    in the run's stacks/ under its node's name. One MLflow run holds both launches: the
    straggler's tag and the hang's error."""
    workers, straggler, hung = 8, 5, 7
    seen = _project(tmp_path, workers, max_failures=0)
    memory, started, launched = PeakMemory(), time.monotonic(), []
    nodes = Nodes(4)
    try:
        env = cli_env(tmp_path, RAYLANE_FAULTS=f"slow@rank={straggler},ms={STRAGGLER_MS}")
        launched.append(
            first := run_cli("train", "run.yaml", "--address", nodes.address, "--summary-json", "s1.json", env=env)
        )
        group = _group(seen, workers, 12, set())
        where = _placed(nodes, group)
        _spread(where, list(nodes.named))
        line = _straggler_named(first, straggler, where[straggler])
        leaving = next(n for n in nodes.named if n not in (where[straggler], where[hung]))
        nodes.drain(leaving)
        assert first.wait(300) == 130, first.output
        s1 = read_json(tmp_path / "s1.json")
        assert s1["status"] == "KILLED" and s1["preempted"], s1
        notice = f"(Ray's preemption notice: node {nodes.named[leaving].node_id[:8]} is draining, going in "
        assert notice in s1["error"], s1["error"]
        assert [x["rank"] for x in s1["stragglers"]] == [straggler]
        assert s1["stragglers"][0]["node"] == where[straggler]

        hang = f"hang@rank={hung},step={s1['steps'] + 3}"
        launched.append(again := run_cli("train", "run.yaml", "--address", nodes.address, "--summary-json", "s2.json",
                        env=cli_env(tmp_path, RAYLANE_FAULTS=hang), name="again"))  # fmt: skip
        group = _group(seen, workers, s1["steps"] + 1, set(group.values()))
        after = _placed(nodes, group)
        _spread(after, [n for n in nodes.named if n != leaving])
        assert again.wait(300) == 1, again.output
    finally:
        nodes.shutdown()
        _report("4 nodes, 8 workers", started, memory, *(x.output for x in launched))
    s2 = read_json(tmp_path / "s2.json")
    assert s2["status"] == "FAILED" and f"resumed from step {s1['steps']}\n" in again.output, s2
    assert _hung_line(hung, after[hung]) in s2["error"], s2["error"]
    assert (tmp_path / "runs" / "soak" / "stacks" / f"rank{hung}-{after[hung]}.txt").exists()
    run = MlflowClient(s2["tracking_uri"]).get_run(s2["run_id"])
    assert s2["run_id"] == s1["run_id"] and run.info.status == "FAILED"
    assert run.data.tags["raylane.error"] == s2["error"]
    assert run.data.tags[f"raylane.straggler.rank{straggler}"] == line.removeprefix("[raylane] ")


@pytest.mark.slow  # ~15 minutes on 2 busy cores: 16 workers started three times, two hangs
@pytest.mark.timeout(1800)
def test_on_8_nodes_16_workers_hand_over_without_a_drained_node_then_a_hang_is_named(run_cli, tmp_path):
    """16 workers on 8 nodes, SPREAD: 2 a node. Rank 13 is slow: named with its node. Ray's drain
    notice to a node holding neither rank 13 nor rank 15: at failure.max_failures 1 the group
    checkpoints at one step and hands over, the line naming the drained node, and restarts on the
    7 nodes left (none on the drained one, SPREAD: 3 on two of them, 2 on the others). Rank 15
    hangs at step 50: restarted once (failure.max_failures 1), it hangs again and the run fails with
    the line naming rank 15, its node and where it stood."""
    workers, straggler, hung, hang_at = 16, 13, 15, 50
    seen = _project(tmp_path, workers, max_failures=1)
    memory, started = PeakMemory(), time.monotonic()
    nodes = Nodes(8)
    try:
        faults_env = f"slow@rank={straggler},ms={STRAGGLER_MS};hang@rank={hung},step={hang_at}"
        p = run_cli("train", "run.yaml", "--address", nodes.address, "--summary-json", "s.json",
                    env=cli_env(tmp_path, RAYLANE_FAULTS=faults_env))  # fmt: skip
        group = _group(seen, workers, 12, set())
        where = _placed(nodes, group)
        _spread(where, list(nodes.named))
        _straggler_named(p, straggler, where[straggler])
        leaving = next(n for n in nodes.named if n not in (where[straggler], where[hung]))
        nodes.drain(leaving)
        restarted = _group(seen, workers, 1, set(group.values()))
        after = _placed(nodes, restarted)
        _spread(after, [n for n in nodes.named if n != leaving])
        last = _group(seen, workers, 1, set(group.values()) | set(restarted.values()))  # after the first hang
        final = _placed(nodes, last)
        # SPREAD is Ray's best effort: a restart after a failure places the new group while the old
        # one's CPUs are still being freed (seen: 4, 4, 3, 2, 1, 1, 1 over the 7 nodes), so only
        # the drained node's absence is asked of it (a GPU a worker leaves Ray no such choice).
        assert leaving not in final.values() and len(final) == workers, final
        assert p.wait(900) == 1, p.output
    finally:
        nodes.shutdown()
        _report("8 nodes, 16 workers", started, memory, p.output)
    notice = f"(Ray's preemption notice: node {nodes.named[leaving].node_id[:8]} is draining, going in "
    handover = next(x for x in p.output.splitlines() if "their node is leaving" in x)
    # Both of the node's ranks get the notice, each at its own look: the step both agree to stop at
    # may come after only one has (seen: 'notice to 1 of 16 ranks').
    assert any(f"notice to {k} of {workers} ranks that their node is leaving {notice}" in handover for k in (1, 2)), (
        handover
    )
    assert handover.endswith("; the group restarts without the leaving node"), handover
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FAILED" and s["restarts"] >= 1, s
    assert _hung_line(hung, final[hung]) in s["error"], s["error"]
    run = MlflowClient(s["tracking_uri"]).get_run(s["run_id"])
    assert run.info.status == "FAILED" and run.data.tags["raylane.error"] == s["error"]
    # Each group start names the straggler again (its steps are timed afresh): MLflow's tag keeps
    # the first line (MetricLogger.set_first_tags; it took each later start's before).
    named = [x.removeprefix("[raylane] ") for x in p.output.splitlines() if f"straggler: rank {straggler} on " in x]
    assert len(named) >= 2 and f"straggler: rank {straggler} on {where[straggler]} takes " in named[0], named
    assert any(f"straggler: rank {straggler} on {g[straggler]} takes " in named[-1] for g in (after, final)), named
    assert run.data.tags[f"raylane.straggler.rank{straggler}"] == named[0]
