"""`raylane autotune` on the ranks: one process group profiles every candidate configuration.

Start-up (processes, process group, imports, the pipeline's data) is paid once. Each candidate
then gets a fresh copy of the pipeline's model, its own wrapping (DDP or FSDP), optimizer and
loader, runs `warmup_steps` and `profile_steps` optimizer steps through the Trainer's own
`run_step` (so it measures what training runs), and is torn down before the next one
(raylane.autotuning.profile).

Out of memory is agreed, not left to hang a collective. A candidate's model is built and its
memory estimated (rank 0 prunes what cannot fit) before any collective; then one micro-batch's
forward and backward run without gradient sync (no collective under DDP). Each of these ends
with one all-reduce of "any rank out of memory?", so a candidate that does not fit on one rank
is infeasible on all of them. An OOM later, inside a collective, can still hang the group: the
run's dist.timeout_s ends it, and a relaunch (or Ray's restart) replays the search's record and
marks that candidate failed instead of trying it again.

Rank 0 plans (`plan`, a generator: the next candidate depends on the last outcomes) and sends
each candidate to every rank (raylane.autotuning.agree), and keeps the record a relaunch replays
(raylane.autotuning.record). Ray-free, like the rest of the loop."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Any

from raylane.autotuning.agree import Agreement
from raylane.autotuning.order import plan
from raylane.autotuning.profile import Profiler
from raylane.autotuning.ranking import merge, next_round
from raylane.autotuning.record import SearchRecord, fingerprint
from raylane.config import BaseConfig
from raylane.config.autotune import SearchSettings
from raylane.loop import usercode
from raylane.loop.distributed.fsdp import on_meta
from raylane.loop.protocols.events import Candidate, Event, Round, SearchEnd, SearchStart
from raylane.loop.protocols.result import Outcome, SearchResult
from raylane.loop.protocols.runtime import Runtime

Planner = Generator[dict[str, Any], Outcome, None]


@dataclass(frozen=True, slots=True)
class Message:
    """What rank 0 sends every rank next: a candidate's values to measure (`index`: a later
    round of that candidate), or, `replayed`, its outcome from an earlier launch's record."""

    values: dict[str, Any]
    replayed: Outcome | None = None
    index: int = -1


class Search:
    """The whole search on this rank: rank 0 plans and every rank profiles each candidate it
    sends; rank 0 publishes a `Candidate` per outcome, a `Round` per later round, and the result
    as the `SearchEnd` event."""

    def __init__(
        self, cfg: BaseConfig, runtime: Runtime, settings: SearchSettings, publish: Callable[[Event], None]
    ) -> None:
        self.cfg, self.runtime, self.settings, self.publish = cfg, runtime, settings, publish
        self.rank0 = runtime.rank == 0
        self.agree = Agreement(runtime, cfg.scaling.use_gpu)
        self.record = SearchRecord(settings.record, fingerprint(cfg.flat(), settings))

    def run(self) -> SearchResult:
        """Every candidate's outcome, in order (what SearchEnd carries)."""
        started = time.perf_counter()
        pipe = usercode.build_pipeline(self.cfg)  # the data, and the model every candidate copies
        if not on_meta(pipe.model):  # a meta model gets memory in each candidate
            pipe.model.to("cpu")
        # Each candidate's teardown collects garbage: leave what lives the whole search (imports,
        # the data) out of those collections (a full one took ~0.7 s on 2 busy cores).
        gc.collect()
        gc.freeze()
        self.profiler = Profiler(self.cfg, self.runtime, self.settings, self.agree, pipe)
        if self.rank0:
            self.publish(SearchStart(time_unix=time.time()))
        planner = plan(self.settings.space, self.settings.own) if self.rank0 else None
        replay, rounds_replay = self.record.replay() if self.rank0 else ([], [])
        deadline = started + self.settings.budget_s if self.settings.budget_s else None
        outcomes = self._first_rounds(planner, replay, deadline)
        self._measure_again(outcomes, rounds_replay, deadline)
        result = SearchResult(
            candidates=outcomes,
            wall_s=time.perf_counter() - started,
            world_size=self.runtime.world_size,
            estimate_margin=self.settings.safety_margin,
            device=self.runtime.device.type,
        )
        if self.rank0:
            self.publish(SearchEnd(time_unix=time.time(), result=result))
        gc.unfreeze()
        return result

    def _first_rounds(self, planner: Planner | None, replay: list[Outcome], deadline: float | None) -> list[Outcome]:
        """The search order's candidates, each measured once (or replayed), until it ends."""
        outcome: Outcome | None = None
        outcomes: list[Outcome] = []
        while True:
            message = self._next(planner, outcome, replay, deadline, len(outcomes)) if self.rank0 else None
            message = self.agree.broadcast(message)
            if message is None:
                return outcomes
            if message.replayed is not None:
                outcome = replace(message.replayed, replayed=True)
            else:
                if self.rank0:
                    self.record.started(message.values)
                outcome = self.profiler.profile(message.values)
                if self.rank0:
                    self.record.outcome(outcome)
            outcomes.append(outcome)
            if self.rank0:
                self.publish(Candidate(index=len(outcomes) - 1, replayed=outcome.replayed, outcome=outcome))

    def _measure_again(
        self, outcomes: list[Outcome], replay: list[tuple[int, Outcome]], deadline: float | None
    ) -> None:
        """Rounds after the search order's: the candidates whose ranking against the leader is
        not clear yet (ranking.next_round) are measured once more each, the leader first,
        until it is clear, or each has `max_rounds`, or the budget is spent."""
        queue: list[int] = []
        while True:
            message = self._next_round(outcomes, queue, replay, deadline) if self.rank0 else None
            message = self.agree.broadcast(message)
            if message is None:
                return
            index = message.index
            if message.replayed is not None:
                again = message.replayed
            else:
                if self.rank0:
                    self.record.started_round(index)
                again = self.profiler.profile(message.values, again=True)
                if self.rank0:
                    self.record.round_of(index, again)
            outcomes[index] = merge(outcomes[index], again)
            if self.rank0:
                self.publish(
                    Round(
                        index=index,
                        rounds=outcomes[index].rounds,
                        replayed=message.replayed is not None,
                        outcome=outcomes[index],
                    )
                )

    def _next_round(
        self, outcomes: list[Outcome], queue: list[int], replay: list[tuple[int, Outcome]], deadline: float | None
    ) -> Message | None:
        if deadline and time.perf_counter() > deadline:
            return None
        if not queue:
            queue.extend(
                next_round(
                    outcomes,
                    self.settings.own,
                    self.settings.space,
                    min_rounds=self.settings.min_rounds,
                    max_rounds=self.settings.max_rounds,
                )
            )
            if not queue:
                return None
        index = queue.pop(0)
        message = Message(outcomes[index].values, index=index)
        if replay and replay[0][0] == index:
            return replace(message, replayed=replay.pop(0)[1])
        replay.clear()  # the earlier launch went another way from here
        return message

    def _next(
        self, planner: Planner | None, outcome: Outcome | None, replay: list[Outcome], deadline: float | None, done: int
    ) -> Message | None:
        if planner is None or done >= self.settings.max_candidates or (deadline and time.perf_counter() > deadline):
            return None
        try:
            values = planner.send(outcome) if outcome is not None else next(planner)
        except StopIteration:
            return None
        if done < len(replay) and replay[done].values == values:
            return Message(values, replayed=replay[done])
        return Message(values)


def run_search(cfg: BaseConfig, runtime: Runtime, settings: SearchSettings) -> SearchResult:
    """The whole search on this rank (every rank calls it); rank 0 publishes a `Candidate` event
    per outcome and the result as the `SearchEnd` event. `settings`: autotune's settings(), as
    the driver hands them to the worker group."""
    publish = runtime.publish if runtime.rank == 0 else (lambda e: None)
    return Search(cfg, runtime, settings, publish).run()
