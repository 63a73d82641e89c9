"""Semi-synchronous replica groups (`fault_tolerance.semi_sync`, docs/fault-tolerance.md): each
group takes its optimizer steps on its own (no gradient crosses groups) and the groups meet every
`sync_steps` steps, through torchft's own algorithms, hooked on the optimizer's step:
`local_sgd` (torchft.local_sgd.LocalSGD) averages their parameters; `diloco` (DiLoCo) averages
their parameters' change since the last meeting (the pseudo-gradient) and steps an outer
optimizer, SGD(outer_lr, outer_momentum, outer_nesterov), on it from the last meeting's weights.
So a run matches torchft's own use of them on the same model and data
(tests/e2e/test_ft_loop.py), and the Trainer's step runs as without groups between meetings.

The Manager counts meetings, not steps, with a synchronous quorum (DiLoCo needs it): a quorum is
taken at each meeting only, and a group behind the others (restarted, or a meeting it did not
commit) copies a live peer's state there (weights, optimizer, the Trainer's position and, under
DiLoCo, its last meeting's weights and outer momentum), in the middle of its optimizer step; the
Trainer then goes on from the peer's position. Its count starts at 0 at every start of a group, below any
live peer's that has met once since its own start, so that a restarted group always copies a live
peer at its first meeting rather than going on from its checkpoint (a checkpoint is the leading
group's own state at its step, not the groups' common one between meetings). At the first meeting
of a run's start torchft's `init_sync` has every group copy the first's (their steps since the
start on its data; torchft's own behaviour, kept)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from raylane.loop.distributed.ft import ReplicaGroup, ReplicaGroups, reseed


class SemiSync(ReplicaGroups):
    """A replica group's steps between its meetings with the others (see the module's doc)."""

    reduces_gradients = False

    def __init__(
        self,
        manager: Any,
        group: ReplicaGroup,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        semi_sync: Any,
        **kw: Any,
    ) -> None:
        super().__init__(manager, group, model, optimizer, **kw)
        self.model, self.semi_sync = model, semi_sync
        self._inner = 0  # optimizer steps since this group started
        self._synced = 0  # meetings committed since it started
        self._met = False  # this group has met the others since it started
        self._healed_to = 0  # the Trainer's step a heal put it at
        # Until the first meeting says which group leads: the first, as at a run's start.
        self._reporter.leads = group.index == 0

    def carry(self, state_dict: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        def healed(state: dict[str, Any]) -> None:
            load(state)
            self._healed, self._healed_to = True, int(state["step"])

        self.manager.register_state_dict_fn("trainer", healed, state_dict)

    @contextlib.contextmanager
    def joined(self, step: int) -> Iterator[None]:
        """torchft's algorithm on the optimizer from the step the loop starts at (after any resume:
        DiLoCo keeps these weights as the last meeting's), its count of meetings at 0."""
        self.manager.load_state_dict({"step": 0, "batches_committed": 0})
        self._began_at = step
        try:
            with self._algorithm():
                # After the algorithm's own hook, which meets the others every sync_steps steps.
                after = self.optimizer.register_step_post_hook(self._after_step)
                try:
                    yield
                finally:
                    after.remove()
        finally:
            self.manager.shutdown(wait=False)

    def _algorithm(self) -> Any:
        from torchft.local_sgd import DiLoCo, LocalSGD

        s = self.semi_sync
        if s.method == "local_sgd":
            return LocalSGD(self.manager, self.model, self.optimizer, sync_every=s.sync_steps)
        # Nesterov without momentum is plain SGD, which torch refuses to be asked for that way.
        outer = torch.optim.SGD(
            self.model.parameters(),
            lr=s.outer_lr,
            momentum=s.outer_momentum,
            nesterov=s.outer_nesterov and s.outer_momentum > 0,
        )
        return DiLoCo(self.manager, [self.model], self.optimizer, outer, sync_every=s.sync_steps)

    # -- a step --------------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        reseed(self._seed, step)  # the random generators by step, as ReplicaGroups'
        self._started, self._began_at = time.perf_counter(), step

    def reduce(self) -> None:
        """Nothing crosses groups in a step: they meet in the optimizer's step, every sync_steps."""

    def commit(self) -> bool:
        self.committed = True  # each group steps on its own
        return True

    def leads(self) -> bool:
        return self.manager.participating_rank() == 0 if self._met else self.group.index == 0

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """After each optimizer step: where the algorithm just met the others, its outcome."""
        self._inner += 1
        every = self.semi_sync.sync_steps
        if self._inner % every:
            return
        self._met = True
        if self.manager.current_step() == self._synced:
            self._refused()  # not committed: a refused heal ends the run; a lost peer is met again
            return
        self._synced = self.manager.current_step()
        step = (self._healed_to if self._healed else self._began_at) + 1
        self._count(self.manager.num_participants(), step, steps=every)
