"""What a run prints about where it is, through the real Trainer and display (one process): the
last progress line names the epoch its last step was in, and the run's final evaluation is named
by its step when a stop cut the epoch short, by its epoch when the epoch had ended (issue 60,
finding 10: `epoch 1/12 step 60/60` was printed right after `epoch 2 eval`, both wrong)."""

from __future__ import annotations

import pytest

from tests.helpers.own_lines import foreign


def _lines(proc) -> list[str]:
    assert proc.wait(180) == 0, proc.output
    assert not foreign(proc.output), foreign(proc.output)
    return [line for line in proc.output.splitlines() if line.startswith("[raylane] ")]


@pytest.mark.untracked
def test_the_last_line_and_the_final_evaluation_name_the_epoch_they_are_in(run_cli):
    common = ("train", "regression", "--local", "--set", "train.max_epochs=2", "--set", "run.storage_path=runs")
    # 64 steps an epoch: a max_steps stop 36 steps into the second.
    cut = run_cli(*common, "--set", "train.max_steps=100", "--set", "run.name=cut", name="cut")
    # Evaluated at the end only: the second epoch had ended.
    ended = run_cli(*common, "--set", "train.eval_every_n_epochs=0", "--set", "run.name=ended", name="ended")
    lines = _lines(cut)
    assert [line.split(":")[0] for line in lines if " eval: " in line] == [
        "[raylane] epoch 1 eval",
        "[raylane] step 100 eval",
    ]
    assert lines[-1].startswith("[raylane] epoch 2/2 step 100/100 (100%)"), lines
    lines = _lines(ended)
    assert [line.split(":")[0] for line in lines if " eval: " in line] == ["[raylane] epoch 2 eval"]
    assert lines[-1].startswith("[raylane] epoch 2/2 step 128/128 (100%)"), lines
