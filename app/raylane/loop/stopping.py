"""The step-boundary vote: decisions every rank of the group takes at the same step, which no rank
may take alone. Whether to stop now (a preemption request, a notice that a node is leaving, the
launcher's request to hand over to a larger group: raylane.loop.preemption), and whether the
save in flight has been committed by every rank (raylane.loop.checkpoint.saving). Never imports Ray.

Each vote is a collective outside DDP's, which costs a few ms on 2 busy CPU cores (one rank waits
to be scheduled): the group votes about every VOTE_INTERVAL_S, after a step count agreed at each
vote from rank 0's step time. A stop waits at most that long; nothing is lost either way. Every
rank's step times of a logging window ride on the vote that follows it (raylane.loop.observe.steptimes):
a few more numbers in the same all-reduce, not a collective of their own."""

from __future__ import annotations

import time
from typing import Any

from raylane.loop import preemption
from raylane.loop.distributed.ft import replica_group
from raylane.loop.distributed.groups import ControlVote
from raylane.loop.protocols.runtime import Runtime

VOTE_EVERY_N_STEPS = 10  # the first vote; then about every VOTE_INTERVAL_S
VOTE_INTERVAL_S = 0.5
VOTE_MAX_STEPS = 1000


class StepVote:
    """The vote, and what the last one decided: `preempted` (stop now, with a checkpoint), and why:
    `node_leaving` (the launcher restarts the group without the node), `growing` (it restarts
    the group larger), or the run is being stopped."""

    def __init__(self, runtime: Runtime, control_group: Any = None) -> None:
        # Booleans [stop now, async save not yet committed, the launcher asked for a handover to a
        # larger group], and values [rank 0's step time, ranks whose node is leaving].
        self.vote = ControlVote(3, control_group)
        self.rank, self.world_size = runtime.rank, runtime.world_size
        self.restarts = runtime.restarts_without_leaving_nodes
        self.replica_group = replica_group() is not None  # one group of the run (fault_tolerance)
        self.preempted = False
        self.node_leaving = False
        self.growing = False
        self.leaving_ranks = 0
        self.gathered: list[float] = []  # the last poll's per_rank figures, every rank's in rank order
        self.start(0)

    def start(self, step: int) -> None:
        """The loop starts (or resumes) at `step`: the first vote comes soon after."""
        self.next_step = step + (VOTE_EVERY_N_STEPS if self.vote.distributed else 1)
        self._last = (time.perf_counter(), step)

    def due(self, step: int) -> bool:
        return step >= self.next_step

    def poll(self, step: int, save_busy: bool, per_rank: tuple[float, ...] = ()) -> tuple[bool, bool]:
        """Collective, at `step`: (stop now, the save in flight has been committed by every rank).
        `save_busy`: this rank's save in flight has not finished. `per_rank`: this rank's figures,
        gathered from every rank into `gathered` (every rank must give as many, or none)."""
        started, last_step = self._last
        step_s = (time.perf_counter() - started) / max(step - last_step, 1) if self.rank == 0 else 0.0
        (stop, busy, growing), (agreed_step_s, leaving, *self.gathered) = self.vote.poll(
            preemption.requested(),
            save_busy,
            preemption.growing(),
            values=(step_s, float(preemption.node_leaving())),
            per_rank=per_rank,
        )
        self.next_step = step + min(max(int(VOTE_INTERVAL_S / max(agreed_step_s, 1e-6)), 1), VOTE_MAX_STEPS)
        self._last = (time.perf_counter(), step)
        self.preempted = stop
        self.leaving_ranks = round(leaving)
        restarts = stop and self.restarts
        # A notice to some of the ranks: restart without them. To every rank (a scheduler's
        # scancel, `timeout`): the run is being stopped, as by the driver; but every rank of a
        # replica group is one group of the run, whose node is leaving: it restarts alone while
        # the others step on (a stop of the whole run reaches every group from the driver). A
        # notice wins over a growth request in the same vote (the group would lose a node).
        every = self.replica_group and self.leaving_ranks == self.world_size
        self.node_leaving = restarts and (0 < self.leaving_ranks < self.world_size or every)
        self.growing = restarts and growing and not self.leaving_ranks
        return stop, not busy

    def reason(self) -> str:
        """Why the group stopped (once `preempted`)."""
        if self.growing:
            return preemption.GROWING
        if self.node_leaving:
            # Which node: the launcher's notice where it names it (Ray's drain notice, which every
            # rank reads, rank 0 too); a signal to a leaving rank's own process names none here.
            notice = preemption.reason()
            which = f" ({notice})" if notice else ""
            return f"notice to {self.leaving_ranks} of {self.world_size} ranks that their node is leaving{which}"
        return preemption.reason() or "a stop request from another rank"

    def gather(self, per_rank: tuple[float, ...]) -> list[float]:
        """Every rank's `per_rank`, in rank order: collective, after the loop (its last window)."""
        return self.vote.poll(per_rank=per_rank)[1]

    def close(self) -> None:
        self.vote.close()
