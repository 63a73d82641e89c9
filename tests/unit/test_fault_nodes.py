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
