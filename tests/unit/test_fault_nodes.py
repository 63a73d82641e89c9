"""Each fault of the many-node soak (tests/e2e/test_many_nodes.py) is named with its node, in
process here: a drain notice that restarts the group without the node (the handover's line).
The soak itself, on Ray's fake multi-node cluster: tests/e2e/test_many_nodes.py."""

from __future__ import annotations

import time

from ray.train import PreemptionInfo

from raylane.loop import preemption
from raylane.loop.stopping import StepVote
from tests.unit.test_drain_notice import LEAVING, _worker, fresh_request  # noqa: F401 - the fixture


def test_a_handover_for_a_drain_notice_names_the_leaving_node(monkeypatch, tmp_path):
    """A group that restarts without a node (failure.max_failures > 0): Ray's notice reaches the
    leaving node's ranks (rank 1 here), and rank 0, on a node that stays, gives the reason the
    driver prints. It named the count of ranks and no node ('notice to 1 of 2 ranks that their
    node is leaving'): at 16 workers on 8 nodes, which node had left was nowhere on the terminal."""
    notice = _worker(monkeypatch, tmp_path, 0, restarts=True)
    deadline_ms = int((time.time() + 60) * 1000)
    notice.preemption_info = PreemptionInfo(deadline_ms=deadline_ms, preempted_node_to_ranks={LEAVING: [1]})
    time.sleep(0.2)  # 20 polls: rank 0 is not leaving, and asks nothing itself
    assert not preemption.requested()
    vote = StepVote(notice.runtime)
    # What the vote decided on rank 1's request (one rank of the two leaving; the group restarts).
    vote.preempted, vote.node_leaving, vote.leaving_ranks = True, True, 1
    assert vote.reason().startswith(
        "notice to 1 of 2 ranks that their node is leaving (Ray's preemption notice: node a1b2c3d4 is draining, "
        "going in "
    ), vote.reason()


def _dump(*frames: str) -> str:
    """A rank's stacks as faulthandler writes them: its training thread (the main one), innermost first."""
    return "Current thread 0x0000000000000001 (most recent call first):\n" + "".join(
        f'  File "{file}", line {line} in {function}\n' for file, line, function in frames
    )


def test_a_hang_names_the_hung_rank_with_its_node_and_not_the_ranks_collecting_stacks():
    """At 8 ranks on 4 fake nodes (the soak), rank 7 hung in the fault plan while every other
    rank's collective timed out at once; the line read 'never reached it: rank 1 at
    .../hangs.py:290 in diagnose; rank 2 at .../hangs.py:317 in _collected_line; rank 7 at
    .../faults.py:90 in before_step': the ranks asked while they diagnosed were named as hung,
    and no rank's node was said. Now: rank 7 alone, on its node."""
    from raylane.loop.observe import hangs

    entry = lambda rank, node: hangs.RankEntry(rank, 100 + rank, "h", 1, "/runs/soak", node)  # noqa: E731
    diagnosing = _dump((hangs.__file__, 317, "_collected_line"), (hangs.__file__, 290, "diagnose"))
    collecting = _dump((hangs.__file__, 150, "collect"), (hangs.__file__, 301, "diagnose"))
    hung = _dump(
        ("/app/raylane/loop/observe/faults.py", 90, "before_step"), ("/app/raylane/loop/trainer.py", 260, "step")
    )
    peers = [entry(1, "node-0"), entry(2, "node-1"), entry(7, "node-3")]
    line = hangs.hang_line(15, peers, {1: diagnosing, 2: collecting, 7: hung}, 7, "/runs/soak/stacks")
    assert line == (
        "a collective waited past dist.timeout_s = 15 s: never reached it: rank 7 on node-3 at "
        "/app/raylane/loop/observe/faults.py:90 in before_step; 4 ranks left no record in the run folder; "
        "every rank's stack in /runs/soak/stacks"
    )
    # Ranks stuck at one place on many nodes: two named, the rest counted (the line stays bounded).
    stuck = [entry(r, f"node-{r // 2}") for r in range(8, 16)]
    line = hangs.hang_line(15, stuck, {e.rank: hung for e in stuck}, 8, "/s")
    assert "never reached it: ranks 8-15 on node-4, node-5 and 2 more nodes at /app/raylane/loop/" in line, line


def test_a_failed_groups_line_leaves_the_ranks_that_lost_a_peer_as_a_count():
    """16 ranks on 8 fake nodes, rank 15 hung: 12 ranks failed with the hang's line and 3 with
    gloo's 'Connection closed by peer [addr]:port' (the collector exited first), each port its own:
    the line carried each of them, 150 characters a rank, and would carry 255 at 256 ranks. Now
    the ranks that echo another's failure are a count after it; distinct causes, 3 at most."""
    from raylane.loop.observe.hangs import HangError
    from raylane.onray.failures import format_failure

    hang = "a collective waited past dist.timeout_s = 15 s: never reached it: rank 15 on node-1 at /p.py:9 in f"
    closed = "[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:{}. This is typically caused"
    failures = {r: HangError(hang) for r in (0, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 14)}
    failures |= {r: RuntimeError(closed.format(30000 + r)) for r in (1, 6, 13)}
    line = format_failure(type("E", (Exception,), {"worker_failures": failures})(), 16)
    assert line == f"training failed on ranks 0, 2-5, 7-12, 14: {hang} (ranks 1, 6, 13: a peer gone, after it)"
    at_256 = {0: ValueError("bad shape")} | {r: RuntimeError(closed.format(r)) for r in range(1, 256)}
    line = format_failure(type("E", (Exception,), {"worker_failures": at_256})(), 256)
    assert line == "training failed on rank 0: ValueError: bad shape (ranks 1-255: a peer gone, after it)"
    distinct = {r: ValueError(f"bad row {r}") for r in range(5)}
    line = format_failure(type("E", (Exception,), {"worker_failures": distinct})(), 5)
    assert line.endswith("rank 2: ValueError: bad row 2 (and 2 other errors)"), line


def test_a_group_whose_ranks_refused_their_config_fails_as_that_configerror():
    """Every rank that failed of itself raised a ConfigError (a pipeline's build refusing its
    config: bad input, exit 2): the driver raises the lowest rank's, not a TrainingError; the ranks
    that lost a peer after it do not count, and one rank failing otherwise keeps the usual line."""
    import pickle

    from raylane.errors import ConfigError
    from raylane.onray.failures import bad_input, format_failure

    def group(failures: dict) -> Exception:
        # Through pickle, as Ray brings a worker's exception to the driver.
        return type("E", (Exception,), {"worker_failures": pickle.loads(pickle.dumps(failures))})()

    refused = {r: ConfigError(f"invalid config: data.x = {r}: no") for r in (3, 1)}
    closed = RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3000")
    found = bad_input(group({**refused, 0: closed, 2: closed}))
    assert isinstance(found, ConfigError) and str(found) == "invalid config: data.x = 1: no"
    assert bad_input(group({**refused, 2: ValueError("bad shape")})) is None
    assert bad_input(group({0: closed})) is None and bad_input(Exception("no group")) is None
    line = format_failure(group({**refused, 2: ValueError("bad shape")}), 4)
    assert line.startswith("training failed on rank 1: invalid config: data.x = 1: no; rank 2: ValueError: bad"), line
    # Not restarted, whatever failure.max_failures allows: it would refuse its config again.
    from ray.train import FailureConfig

    from raylane.onray.elastic import HandoverFailurePolicy
    from raylane.onray.internals import FailureDecision

    policy = HandoverFailurePolicy(FailureConfig(max_failures=3))
    assert policy.make_decision(group({**refused, 0: closed})) == FailureDecision.RAISE


def test_a_rank_that_lost_a_peer_to_a_hangs_diagnosis_fails_with_the_hangs_line(tmp_path):
    """16 ranks on 8 fake nodes, rank 15 hung: gloo closed the timed-out ranks' connections and
    ranks 1, 6 and 13 failed at once with 'Connection closed by peer', before any rank's hang
    line was written; Ray Train tore the group down on those alone, and the run's line named no
    hang. Now such a rank fails with the line of the rank that collects (once it has claimed the
    diagnosis); an echo with no hang behind it is left as it was, within ECHO_WAIT_S."""
    from raylane.loop.observe import hangs

    watch = hangs.HangWatch(str(tmp_path), 6, 16, 15.0)
    watch.start()
    closed = RuntimeError("[/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:48541")
    try:
        started = time.monotonic()
        assert watch.diagnose(closed) is None  # no hang behind it
        assert time.monotonic() - started < hangs.ECHO_WAIT_S + 1
        line = "a collective waited past dist.timeout_s = 15 s: never reached it: rank 15 on node-1 at /p.py:9 in f"
        (tmp_path / hangs.RANKS / hangs.COLLECTOR).write_text("3")
        (tmp_path / hangs.RANKS / hangs.LINE).write_text(line)
        error = watch.diagnose(closed)
        assert isinstance(error, hangs.HangError) and str(error) == line
        assert watch.diagnose(ValueError("bad shape")) is None  # a rank's own error is its own
    finally:
        watch.close()
