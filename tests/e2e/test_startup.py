"""The start-up breakdown in the summary (timing.startup): every phase, in the order they happen."""

from __future__ import annotations

from raylane.loop.observe.startup import TORCHRUN_PHASES
from tests.conftest import TORCHRUN, read_json


def test_startup_phases_in_order_under_torchrun(run_cli, tmp_path):
    p = run_cli(
        "--nproc_per_node",
        "1",
        "-m",
        "raylane",
        "train",
        "regression",
        "--set",
        "train.max_steps=1",
        "--set",
        "checkpoint.every_n_epochs=0",
        "--set",
        "mlflow.log_model=false",  # after the run: no phase of the start-up (`tracking` opens the run)
        "--summary-json",
        "s.json",
        launcher=TORCHRUN,
        fresh=True,  # the phases start at torchrun's own start: the processes of their own
    )
    assert p.wait(180) == 0, p.output
    timing = read_json(tmp_path / "s.json")["timing"]
    startup = timing["startup"]
    assert sorted(startup) == sorted(TORCHRUN_PHASES), startup
    seconds = [startup[ph] for ph in TORCHRUN_PHASES]
    assert seconds == sorted(seconds) and seconds[0] == 0, startup
    # The first step is the one the summary's launch_to_first_step_s ends at.
    assert abs(timing["startup_origin_unix"] + startup["first_step"] - timing["first_step_unix"]) < 1e-3
