"""The driver's display: plain, rate-limited lines when the output is a log, not a terminal."""

from __future__ import annotations

import io

from raylane.tracking.progress import ProgressDisplay


def _feed(display: ProgressDisplay) -> None:
    display.handle({"event": "start", "total_steps": 100, "steps_per_epoch": 50, "max_epochs": 2,
                    "world_size": 2, "resumed_from_step": 40})
    display.handle({"event": "first_step", "step": 41, "time_unix": 1000.0})
    for step in range(41, 60):
        display.handle({"event": "progress", "epoch": 0, "step": step, "loss": 0.5, "samples_per_s": 1234.0})
    display.handle({"event": "eval", "epoch": 0, "step": 50, "metrics": {"accuracy": 0.9, "loss": 0.3}})
    display.handle({"event": "checkpoint", "step": 50, "location": "/x/checkpoint_000000050"})
    display.handle({"event": "end", "time_unix": 1010.0,
                    "result": {"steps": 100, "epochs": 2, "metrics": {"accuracy": 0.95}}})


def test_log_output_is_plain_and_rate_limited():
    out = io.StringIO()
    display = ProgressDisplay(stream=out, live=False, line_interval_s=3600)
    _feed(display)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[raylane] resumed from step 40"
    # 19 progress events within the interval: one line, then the eval line, then the final line.
    progress = [ln for ln in lines if ln.startswith("[raylane] epoch") and " step " in ln]
    assert progress[0].startswith("[raylane] epoch 1/2 step 41/100 (41%) loss 0.5000 1,234 samples/s eta ")
    assert "[raylane] epoch 1 eval: accuracy 0.9000 loss 0.3000" in lines
    assert progress[-1].startswith("[raylane] epoch 2/2 step 100/100 (100%)")
    assert len(progress) == 2
    assert display.first_step_unix == 1000.0 and display.end_unix == 1010.0
    assert display.result["metrics"] == {"accuracy": 0.95}
    assert display.checkpoints[-1]["location"].endswith("checkpoint_000000050")


def test_terminal_output_is_a_live_bar():
    out = io.StringIO()
    display = ProgressDisplay(stream=out, live=True)
    _feed(display)
    display.close()
    assert display._bar is None  # stopped cleanly
    assert "[raylane] epoch" not in out.getvalue()  # no plain lines on a terminal
