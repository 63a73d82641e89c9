"""The driver's display: plain, rate-limited lines when the output is a log, not a terminal."""

from __future__ import annotations

import io

from raylane.loop.protocols.events import Checkpoint, End, Eval, FirstStep, Log, Progress, Start
from raylane.loop.reporting import Reporter
from raylane.results import TrainSummary
from raylane.tracking.progress import ProgressDisplay, epochs_text, outcome_text, plural
from tests.helpers.run_result import run_result


def _feed(display: ProgressDisplay) -> None:
    display.handle(
        Start(total_steps=100, steps_per_epoch=50, max_epochs=2, world_size=2, host="h", resumed_from_step=40)
    )
    display.handle(FirstStep(step=41, time_unix=1000.0))
    window = {"first_step": 41, "last_step": 41, "loss": 0.5, "samples_per_s": 1234.0}
    for step in range(41, 60):
        display.handle(Progress(epoch=0, step=step, window=window))
    display.handle(Eval(epoch=0, step=50, metrics={"accuracy": 0.9, "loss": 0.3}))
    display.handle(
        Checkpoint(step=50, location="/x/checkpoint_000000050", epoch=0, metrics={}, speed={}, time_unix=1005.0)
    )
    # The last steps' figures come with the end: the last line must not show the window above.
    display.handle(
        End(
            time_unix=1010.0,
            result=run_result(
                steps=100,
                epochs=2,
                metrics={"accuracy": 0.95},
                last_window={
                    "first_step": 91,
                    "last_step": 100,
                    "loss": 0.25,
                    "samples_per_s": 2000.4,
                    "tokens_per_s": 64012.0,
                },
            ),
        )
    )


def test_log_output_is_plain_and_rate_limited():
    out = io.StringIO()
    display = ProgressDisplay(stream=out, live=False, line_interval_s=3600)
    _feed(display)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[raylane] resumed from step 40"
    # 19 progress events within the interval: one line, then the eval line, then the final line.
    progress = [ln for ln in lines if ln.startswith("[raylane] epoch") and " step " in ln]
    assert progress[0].startswith("[raylane] epoch 1/2 step 41/100 (41%) loss 0.5000 1,234 samples/s (step 41) eta ")
    assert "[raylane] epoch 1 eval: accuracy 0.9000 loss 0.3000" in lines
    assert progress[-1].startswith(
        "[raylane] epoch 2/2 step 100/100 (100%) loss 0.2500 2,000 samples/s 64,012 tokens/s (steps 91-100) eta "
    )
    assert len(progress) == 2
    assert display.first_step_unix == 1000.0 and display.end_unix == 1010.0
    assert display.result is not None and display.result.metrics == {"accuracy": 0.95}
    assert display.checkpoints[-1].location.endswith("checkpoint_000000050")


def test_terminal_output_is_a_live_bar():
    out = io.StringIO()
    display = ProgressDisplay(stream=out, live=True)
    _feed(display)
    display.close()
    assert display._bar is None  # stopped cleanly
    assert "[raylane] epoch" not in out.getvalue()  # no plain lines on a terminal


def test_workers_warnings_are_shown_once_as_raylane_lines():
    out = io.StringIO()
    display = ProgressDisplay(stream=out, live=False)
    display.handle(Start(total_steps=10, steps_per_epoch=10, max_epochs=1, world_size=2, host="h"))
    for rank in (0, 1):
        display.handle(Log(rank=rank, level="warning", message="checkpoint x is corrupt"))
    assert out.getvalue().splitlines() == ["[raylane] warning (rank 0): checkpoint x is corrupt"]


def _summary(**changes):
    summary = {
        "run_name": "r",
        "status": "FINISHED",
        "error": None,
        "resumed_from_step": None,
        "steps": 23,
        "epochs": 1,
        "steps_per_epoch": 23,
        "world_size": 2,
        "node_ranks": [0, 0],
        "metrics": {"accuracy": 0.9},
        "run_id": "a" * 32,
        "checkpoint": "/c",
        "samples_per_s": 884.2,
        "tokens_per_s": None,
        "last_window": {"first_step": 21, "last_step": 23, "loss": 0.88968, "samples_per_s": 551.49},
    }
    return TrainSummary.model_validate({**summary, **changes})


def test_the_final_block_names_what_each_figure_measures():
    text = outcome_text(_summary(), "mlflow ui ...")
    assert "  steps:         23 in 1 epoch on 2 workers\n" in text
    assert "  train loss:    0.8897 (steps 21-23, rank 0)\n" in text
    assert "  throughput:    551 samples/s (steps 21-23), 884 samples/s (whole run)\n" in text
    assert "  eval:          accuracy 0.9000\n" in text and "  MLflow UI:     mlflow ui ..." in text


def test_the_final_block_counts_in_words():
    stopped = outcome_text(
        _summary(steps=5, epochs=0, world_size=1, node_ranks=[0], run_id=None, checkpoint=None), "ui"
    )
    assert "  steps:         5 in 0.22 epoch on 1 worker\n" in stopped and "  checkpoint:    none" in stopped
    assert "  MLflow:        not recorded\n" in stopped and "MLflow UI" not in stopped
    two = outcome_text(_summary(steps=60, epochs=2, steps_per_epoch=23, world_size=4, node_ranks=[0, 0, 1, 1]), "ui")
    assert "  steps:         60 in 2.6 epochs on 4 workers across 2 nodes\n" in two
    assert plural(1, "node") == "1 node" and epochs_text(46, 2, 23) == "2 epochs"
    assert epochs_text(3, 0, 410) == "under 0.01 epoch"
    # the loop's own count wins: after a resume that changed the steps per epoch, 154 steps of 56 were 5 epochs
    assert epochs_text(154, 5, 56, partial=0.0) == "5 epochs" and epochs_text(182, 5, 56, partial=0.5) == "5.5 epochs"


def test_the_reporter_names_each_window_by_its_steps():
    events = []
    reporter = Reporter(is_rank_zero=True, publish=events.append)
    reporter.on_start(total_steps=53, steps_per_epoch=30, max_epochs=2, world_size=1, resumed_from_step=40)
    reporter.on_train_metrics(50, {"loss": 1.0, "samples_per_s": 10.0, "lr": 0.1})
    reporter.on_train_metrics(53, {"loss": 0.5, "samples_per_s": 20.0, "lr": 0.1})
    result = reporter.on_end(run_result(steps=53))
    assert result.last_window == {"first_step": 51, "last_step": 53, "loss": 0.5, "samples_per_s": 20.0}
    assert result.steps_per_epoch == 30 and events[-1].result == result


def test_the_last_line_names_the_epoch_its_last_step_was_in():
    """A max_steps stop 15 steps into the second epoch of 45 (issue 60, finding 10: the last line
    read `epoch 1/12 step 60/60` right after the second epoch's evaluation); a run that ended its
    second epoch names the second."""
    for steps, epochs, partial, shown in (
        (60, 1, 0.3333, "epoch 2/12 step 60/60"),
        (90, 2, 0.0, "epoch 2/12 step 90/90"),
    ):
        out = io.StringIO()
        display = ProgressDisplay(stream=out, live=False, line_interval_s=3600)
        display.handle(Start(total_steps=steps, steps_per_epoch=45, max_epochs=12, world_size=1, host="h"))
        display.handle(Progress(epoch=1, step=steps - 1, window=None))
        display.handle(Eval(epoch=1, step=steps, metrics={"accuracy": 0.9}, epoch_end=not partial))
        display.handle(End(time_unix=1.0, result=run_result(steps=steps, epochs=epochs, partial_epoch=partial)))
        lines = out.getvalue().splitlines()
        assert lines[-2] == (
            "[raylane] epoch 2 eval: accuracy 0.9000"
            if not partial
            else f"[raylane] step {steps} eval: accuracy 0.9000"
        )
        assert lines[-1].startswith(f"[raylane] {shown} (100%)"), lines


def test_replica_groups_lost_and_back_are_said_with_the_steps_taken_meanwhile():
    """The leading group's ReplicaQuorum events (issue 62): a loss from the step it showed, a return
    with the steps the others took without the lost group; nothing while all step together."""
    from raylane.loop.protocols.events import ReplicaQuorum

    out = io.StringIO()
    display = ProgressDisplay(stream=out, live=False)
    for alive, step in [(2, 0), (1, 21), (1, 30), (2, 46), (2, 50)]:
        display.handle(ReplicaQuorum(step=step, alive=alive, groups=2))
    assert out.getvalue().splitlines() == [
        "[raylane] replica groups: 1 of 2 step on from step 21",
        "[raylane] replica groups: 1 of 2 step on from step 30",
        "[raylane] replica groups: all 2 step together again from step 46 (the others took 25 steps meanwhile)",
    ]


def test_an_evaluation_without_metrics_prints_no_line():
    """A run without held-out data that stops at train.max_steps ends with an evaluation of
    nothing: before, '[raylane] step 3 eval: ' came out with nothing after it."""
    out = io.StringIO()
    display = ProgressDisplay(stream=out, live=False, line_interval_s=3600)
    display.handle(Start(total_steps=3, steps_per_epoch=45, max_epochs=1, world_size=1, host="h"))
    display.handle(Eval(epoch=0, step=3, metrics={}, epoch_end=False))
    display.handle(Eval(epoch=0, step=3, metrics={"loss": 0.5}, epoch_end=False))
    assert [line for line in out.getvalue().splitlines() if "eval" in line] == ["[raylane] step 3 eval: loss 0.5000"]
