"""The Trainer in one process, on a tiny model (world size 1, CPU, the local runtime on tmp_path),
built as `raylane.loop.run.run_worker` builds it (`build_trainer`): how many steps a run takes,
which steps its checkpoints land at, early stopping, the NaN policy, a bit-exact resume at the
next batch, and a hook's state saved and restored. Each test takes about a second; the e2e tests
(tests/e2e/test_checkpoint.py, test_eval_hooks.py, test_resume.py) prove the same through the CLI,
on several ranks and launchers.

Each test names the bug it was checked against (planted in the Trainer, seen to fail, reverted)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import raylane
from raylane.config import validate
from raylane.loop import checkpoint
from raylane.loop.observe import faults
from raylane.loop.protocols.events import Checkpoint, Eval, Event, FirstStep
from raylane.loop.protocols.result import RunResult
from raylane.loop.run import build_trainer, local_runtime, seed_everything

ROWS = 48  # 6 steps an epoch at batch 8


class Counter(raylane.Hook):
    """A hook with state: the steps it has seen, and a running sum of the first weight."""

    def __init__(self) -> None:
        self.steps = torch.zeros((), dtype=torch.int64)
        self.weight_sum = torch.zeros(())
        self.committed: list[int] = []

    def on_step_end(self, ctx: raylane.HookContext) -> None:
        self.steps += 1
        self.weight_sum += next(ctx.model.parameters()).detach().sum()

    def on_checkpoint(self, ctx: raylane.HookContext) -> None:
        self.committed.append(ctx.step)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "weight_sum": self.weight_sum}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps.copy_(state["steps"])
        self.weight_sum.copy_(state["weight_sum"])


def _data(rows: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(rows, 1, generator=g))


def _config(root: Path, name: str, **sections: dict[str, Any]) -> raylane.BaseConfig:
    train = {"batch_size": 8, "max_epochs": 2, **sections.pop("train", {})}
    return validate(
        {
            "pipeline": "regression",
            "run": {"name": name, "storage_path": str(root)},
            "train": train,
            "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9, **sections.pop("optim", {})},
            "checkpoint": {"keep": None, **sections.pop("checkpoint", {})},
            "mlflow": {"enabled": False, "log_every_n_steps": 2},
            **sections,
        }
    )


class Run:
    """One rank's run in this process: its Trainer (resumed when the run has a checkpoint), and
    the events rank 0 published."""

    def __init__(
        self,
        cfg: raylane.BaseConfig,
        *,
        dropout: float = 0.0,
        hooks: tuple[Any, ...] = (),
        eval_sums: Any = None,
        startup: dict[str, float] | None = None,
    ) -> None:
        self.events: list[Event] = []
        seed_everything(cfg.train.seed)  # as run_worker does, before the pipeline is built
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(dropout), torch.nn.Linear(8, 1))
        pipe = raylane.Pipeline(
            model=model,
            train_set=_data(ROWS, 0),
            eval_set=_data(16, 1),
            loss_fn=torch.nn.functional.mse_loss,
            eval_sums=eval_sums,
            hooks=hooks,
        )
        self.trainer = build_trainer(cfg, local_runtime(cfg, self.events.append), pipe, startup=startup)
        self.root = Path(cfg.run.storage_path) / str(cfg.run.name)

    def train(self) -> RunResult:
        self.result = self.trainer.train()
        return self.result

    def saved(self) -> list[int]:
        """The steps of the checkpoints this Trainer committed, as announced, each on disk."""
        announced = [e.step for e in self.events if isinstance(e, Checkpoint)]
        assert set(announced) <= set(self.on_disk()), (announced, self.on_disk())
        return announced

    def on_disk(self) -> list[int]:
        """The steps of the run's checkpoints on disk, this launch's and earlier ones'."""
        return sorted(int(p.name.rsplit("_", 1)[1]) for p in self.root.glob("checkpoint_*"))

    def evaluated(self) -> list[int]:
        return [e.step for e in self.events if isinstance(e, Eval)]

    def evaluations(self) -> list[tuple[int, int, bool]]:
        """(step, epoch, whether at an epoch's end) of each evaluation, as the display names it."""
        return [(e.step, e.epoch, e.epoch_end) for e in self.events if isinstance(e, Eval)]

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.trainer.model.state_dict().items()}


# Planted: `self.step > self.total_steps` in Trainer._over (one step too many, and an epoch too
# many at an epoch end); and `itertools.islice(batches, self.accum + 1)` in _micro_batches.
@pytest.mark.parametrize(
    ("train", "steps", "epochs", "partial"),
    [
        ({"max_epochs": 2}, 12, 2, 0.0),
        ({"max_epochs": None, "max_steps": 8}, 8, 1, round(2 / 6, 4)),  # as many epochs as 8 steps take
        ({"max_epochs": 1, "max_steps": 8}, 6, 1, 0.0),  # max_epochs set lower decides
        ({"max_epochs": 2, "grad_accum_steps": 4}, 4, 2, 0.0),  # 6 micro-batches: a step of 4, one of 2
    ],
)
def test_a_run_takes_the_steps_its_limits_and_accumulation_give(tmp_path, train, steps, epochs, partial):
    hook = Counter()
    run = Run(_config(tmp_path, "r", train=train), hooks=(hook,))
    result = run.train()
    assert (result.steps, result.epochs, result.partial_epoch) == (steps, epochs, partial)
    assert int(hook.steps) == steps  # optimizer steps taken, each followed by on_step_end
    assert run.saved()[-1] == steps  # the end of the run always saves


# Planted in Saver.due: `step + 1` (every_n_steps off by one), and `epochs + 1` (every_n_epochs).
@pytest.mark.parametrize(
    ("cadence", "epochs", "saved"),
    [
        ({"every_n_steps": 4, "every_n_epochs": 0}, 2, [4, 8, 12]),  # 12: the run's end
        ({"every_n_steps": 0, "every_n_epochs": 2}, 3, [12, 18]),
        ({"every_n_steps": 0, "every_n_epochs": 1}, 2, [6, 12]),
        ({"every_n_steps": 5, "every_n_epochs": 1}, 2, [5, 6, 10, 12]),
        # Step 6 ends an epoch and is due by every_n_steps: saved though every_n_epochs is 0 (it was
        # skipped: the epoch end asked every_n_epochs alone).
        ({"every_n_steps": 3, "every_n_epochs": 0}, 2, [3, 6, 9, 12]),
    ],
)
def test_checkpoints_land_at_their_every_n_steps_and_every_n_epochs(tmp_path, cadence, epochs, saved):
    run = Run(_config(tmp_path, "r", train={"max_epochs": epochs}, checkpoint={"async_save": False, **cadence}))
    run.train()
    assert run.saved() == run.on_disk() == saved
    assert run.evaluated() == [6 * (e + 1) for e in range(epochs)]  # each epoch end, the last included


# Planted: Trainer._over ignoring `evaluation.stopped` (the run trains its 10 epochs).
def test_early_stopping_ends_the_run_at_the_evaluation_that_runs_out_of_patience(tmp_path):
    # No evaluation beats the first by more than min_delta: the 3rd (patience 2) stops the run.
    stopping = {"metric": "loss", "mode": "min", "patience": 2, "min_delta": 1e9}
    run = Run(_config(tmp_path, "r", train={"max_epochs": 10, "early_stopping": stopping}))
    result = run.train()
    assert result.steps == 18 and result.early_stopped and not result.preempted
    assert result.stop_reason.startswith("early stopping: loss did not decrease by more than 1e+09")
    assert run.evaluated() == [6, 12, 18] and run.saved() == run.on_disk() == [6, 12, 18]

    again = Run(_config(tmp_path, "r", train={"max_epochs": 10, "early_stopping": stopping}))
    assert again.train().steps == 18 and again.saved() == []  # an early-stopped run stays stopped
    assert again.on_disk() == [6, 12, 18]


# Planted: `self.skipped_steps += 1` without the `return None` in Trainer.run_step (the NaN update
# is taken: the weights go NaN); and `on_nan == "stopp"` (the run skips where it must stop).
def test_a_nan_loss_stops_the_run_or_skips_its_update_as_train_on_nan_says(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan@step=3")
    stop = Run(_config(tmp_path, "stop", train={"on_nan": "stop"}))
    with pytest.raises(FloatingPointError, match=r"^non-finite loss or gradients at step 3 \(train.on_nan: stop\)$"):
        stop.train()
    assert stop.trainer.step == 2

    skip = Run(_config(tmp_path, "skip", train={"on_nan": "skip"}))
    result = skip.train()
    assert result.steps == 12 and result.skipped_steps == 1
    assert all(torch.isfinite(w).all() for w in skip.weights().values())


def _resumed_from(tmp_path: Path, straight: Run, step: int, name: str) -> Path:
    """A new run whose only checkpoint is `straight`'s at `step`: as if it had stopped there."""
    (tmp_path / name).mkdir()
    shutil.copytree(
        straight.root / checkpoint.checkpoint_name(step), tmp_path / name / checkpoint.checkpoint_name(step)
    )
    return tmp_path / name


# Planted: steps.resumed_batch returning 0 (the epoch starts again from its first batch); and
# Trainer.load_state_dict not loading the scheduler's state (the warmup starts again).
def test_a_resume_continues_at_the_next_batch_bit_for_bit(tmp_path):
    """Dropout draws from torch's generator, and the warmup and the cosine schedule count steps:
    a run resumed at step 4 (mid-epoch) ends with the weights of a run that never stopped."""
    sections = {
        "train": {"max_epochs": 2},
        "optim": {"schedule": "cosine", "warmup_steps": 5},
        "checkpoint": {"every_n_steps": 4},
    }
    straight = Run(_config(tmp_path, "straight", **sections), dropout=0.3)
    straight.train()
    assert straight.saved() == [4, 6, 8, 12]

    _resumed_from(tmp_path, straight, 4, "resumed")
    resumed = Run(_config(tmp_path, "resumed", **sections), dropout=0.3)
    assert (resumed.trainer.step, resumed.trainer.batch_in_epoch) == (4, 4)
    result = resumed.train()
    assert result.steps == 12 and result.resumed_from_step == 4 and resumed.saved() == [6, 8, 12]
    a, b = straight.weights(), resumed.weights()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert resumed.trainer.optimizer.param_groups[0]["lr"] == straight.trainer.optimizer.param_groups[0]["lr"]


# Planted: Trainer.load_state_dict not calling hooks.load_state_dict (the resumed hook counts 8
# steps, not 12); and the saver's on_committed not wired to the hooks (no on_checkpoint call).
def test_a_hooks_state_is_saved_with_each_checkpoint_and_restored_on_resume(tmp_path):
    sections = {"train": {"max_epochs": 2}, "checkpoint": {"every_n_steps": 4}}
    hook = Counter()
    straight = Run(_config(tmp_path, "straight", **sections), hooks=(hook,))
    straight.train()
    assert int(hook.steps) == 12 and hook.committed == [4, 6, 8, 12]

    _resumed_from(tmp_path, straight, 4, "resumed")
    again = Counter()
    resumed = Run(_config(tmp_path, "resumed", **sections), hooks=(again,))
    assert int(again.steps) == 4  # loaded into what setup made, before training
    resumed.train()
    assert int(again.steps) == 12 and again.committed == [6, 8, 12]
    assert torch.equal(again.weight_sum, hook.weight_sum)


# Planted in Evaluation.due: `step + 1` (eval_every_n_steps off by one), `epoch` for `epoch + 1`
# (eval_every_n_epochs), the epoch end not asking eval_every_n_steps; and Evaluation.last taking
# no account of a step already measured (the last step evaluated twice). The Trainer's own
# schedule, before it moved into Evaluation (c8b0060), gave the same lists.
@pytest.mark.parametrize(
    ("train", "evaluations"),
    [
        ({"max_epochs": 2}, [(6, 0, True), (12, 1, True)]),
        # The 3rd epoch's end is not one of every 2: the run's last evaluation, after its last step.
        ({"max_epochs": 3, "eval_every_n_epochs": 2}, [(12, 1, True), (18, 2, True)]),
        # Step 6 ends an epoch and is one of every 3: evaluated as its end, though every_n_epochs is 0.
        (
            {"eval_every_n_epochs": 0, "eval_every_n_steps": 3},
            [(3, 0, False), (6, 0, True), (9, 1, False), (12, 1, True)],
        ),
        # Step 8 is the last, and measured already: no second evaluation at the end.
        (
            {"max_epochs": None, "max_steps": 8, "eval_every_n_epochs": 0, "eval_every_n_steps": 4},
            [(4, 0, False), (8, 1, False)],
        ),
        # A max_steps stop mid-epoch: the last evaluation is named by its step, in its epoch.
        ({"max_epochs": None, "max_steps": 8}, [(6, 0, True), (8, 1, False)]),
        ({"eval_every_n_epochs": 0, "eval_every_n_steps": 0}, [(12, 1, True)]),  # the run's last alone
        (
            {"eval_every_n_epochs": 1, "eval_every_n_steps": 5},
            [(5, 0, False), (6, 0, True), (10, 1, False), (12, 1, True)],
        ),
    ],
)
def test_evaluations_land_at_their_every_n_steps_every_n_epochs_and_the_runs_end(tmp_path, train, evaluations):
    run = Run(_config(tmp_path, "r", train=train, checkpoint={"async_save": False}))
    run.train()
    assert run.evaluations() == evaluations


def _sums_breaking_at(evaluation: int) -> Any:
    """eval_sums that raises from the `evaluation`-th evaluation on (two held-out batches each)."""
    calls = [0]

    def sums(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        calls[0] += 1
        if calls[0] > 2 * (evaluation - 1):
            raise ValueError("a bad held-out row")
        return {"loss": torch.nn.functional.mse_loss(output, target, reduction="sum")}

    return sums


# Planted: the failed evaluation's save left out (the newest checkpoint is an earlier step's); the
# epoch not moved on at an epoch end (a resume would train the ended epoch again); the position
# moved on mid-epoch too (a resume would skip the rest of the epoch).
@pytest.mark.parametrize(
    ("train", "breaks_at", "saved"),
    [
        ({"max_epochs": 3}, 2, (12, 2, 0)),  # at the 2nd epoch's end: saved as the 3rd epoch's start
        ({"eval_every_n_epochs": 0, "eval_every_n_steps": 4}, 2, (8, 1, 2)),  # mid-epoch: where it is
    ],
)
def test_an_evaluation_that_raises_saves_its_step_before_the_error_ends_the_run(tmp_path, train, breaks_at, saved):
    cadence = {"async_save": False, "every_n_epochs": 0, "every_n_steps": 0}
    run = Run(_config(tmp_path, "r", train=train, checkpoint=cadence), eval_sums=_sums_breaking_at(breaks_at))
    with pytest.raises(ValueError, match="^a bad held-out row$"):
        run.train()
    assert run.saved() == run.on_disk() == [saved[0]]
    state = checkpoint.read_manifest(run.root / checkpoint.checkpoint_name(saved[0]))["train_state"]
    assert (state["step"], state["epoch"], state["batch_in_epoch"], state["eval_metrics"]) == (*saved, None)


# Planted: the train data not behind rank 0's FirstBatchClock (no first_batch phase); the clock
# marking each epoch's first batch (first_batch moves to the 2nd epoch's).
def test_rank_zeros_start_up_phases_are_marked_as_they_end_the_first_batch_once(tmp_path):
    phases: dict[str, float] = {}
    run = Run(_config(tmp_path, "r"), startup=phases)
    assert list(phases) == ["parallelize"]  # build_trainer's; run_worker marks the rest
    built = phases["parallelize"]
    result = run.train()
    assert result.steps == 12 and list(phases) == ["parallelize", "first_batch"]
    first = next(e.time_unix for e in run.events if isinstance(e, FirstStep))
    assert built <= phases["first_batch"] <= first
