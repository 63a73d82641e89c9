"""The Python API speaks with the command's voice (issue 47, finding 10): `raylane.train()` in a
script prints the lines `raylane train` prints, and nothing else. Before, a
script saw 58 lines where the command printed 17: Ray's workers' logs in colour, Ray's
token-authentication notice, MLflow's database set-up and its model-logging chatter. The script
has logging of its own (basicConfig at INFO, as a notebook may): the call sets it aside while it
runs and hands it back when it returns."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import cli_env
from tests.helpers.own_lines import foreign

pytestmark = pytest.mark.ray

SCRIPT = """\
import logging, sys
import raylane

logging.basicConfig(level=logging.INFO, format="SCRIPT %(name)s: %(message)s")
mine = list(logging.getLogger().handlers)
raylane.train("regression", sys.argv[1:])
assert logging.getLogger().handlers == mine and logging.getLogger().level == logging.INFO
logging.getLogger("after").info("the script's own logging, as it was")
"""
AFTER = "SCRIPT after: the script's own logging, as it was"


@pytest.mark.slow  # ~30 s on Ray; make test holds the command's own output to its formats (test_ray_e2e.py), which raylane.train() prints through the same driver
@pytest.mark.shared_ray
def test_raylane_train_in_a_script_prints_what_the_command_prints(run_cli, tmp_path):
    """Every line the call prints is one `raylane train` prints (tests/helpers/own_lines.py holds
    the command's formats, which test_ray_e2e holds the command's own output to), the outcome
    block is there whole, and the script's logging is back after the call."""
    (tmp_path / "script.py").write_text(SCRIPT)
    overrides = ["train.max_steps=4", "scaling.num_workers=1", "run.name=voice", "mlflow.log_model=false"]
    proc = run_cli(*overrides, launcher=[sys.executable, str(tmp_path / "script.py")], env=cli_env(tmp_path))
    assert proc.wait(300) == 0, proc.output
    lines = proc.output.splitlines()
    assert lines[-1] == AFTER, lines  # the script's logging is back once the call has returned
    extra = foreign("\n".join(lines[:-1]))
    assert not extra, "printed by raylane.train() and not by `raylane train`:\n" + "\n".join(extra)
    block = [line.split(":")[0].strip() for line in lines if line.startswith("  ")]
    assert block == [
        "steps",
        "train loss",
        "throughput",
        "eval",
        "MLflow run id",
        "checkpoint",
        "MLflow UI",
        "library log",
    ]
    assert "run voice: FINISHED" in lines
