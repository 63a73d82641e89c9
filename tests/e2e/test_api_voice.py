"""The Python API speaks with the command's voice (issue 47, finding 10): `raylane.train()` in a
script prints the lines `raylane train` prints for the same run, and nothing else. Before, a
script saw 58 lines where the command printed 17: Ray's workers' logs in colour, Ray's
token-authentication notice, MLflow's database set-up and its model-logging chatter. The script
has logging of its own (basicConfig at INFO, as a notebook may): the call sets it aside while it
runs and hands it back when it returns."""

from __future__ import annotations

import re
import sys

import pytest

from tests.conftest import cli_env

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


def _normalized(output: str, folder: str) -> list[str]:
    """Lines with what differs between two runs of one config made alike: the run's folder,
    MLflow's ids, and every figure (timings, throughput, a log file's time and pid)."""
    lines = []
    for line in output.replace(folder, "<cwd>").splitlines():
        line = re.sub(r"[0-9a-f]{32}", "<id>", line)
        lines.append(re.sub(r"\d[\d,.]*", "<n>", line))
    return lines


@pytest.mark.shared_ray
def test_raylane_train_in_a_script_prints_what_the_command_prints(run_cli, tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    runs = {}
    for name, launcher in (("command", None), ("api", [sys.executable, str(tmp_path / "script.py")])):
        # Each its own runs/ and MLflow experiment (one database: made once), one run name in both.
        overrides = ["train.max_steps=4", "scaling.num_workers=1", "run.name=voice", "mlflow.log_model=false"]
        overrides.append(f"mlflow.experiment=voice-{name}")
        args = overrides if launcher else ["train", "regression", *(a for o in overrides for a in ("--set", o))]
        folder = tmp_path / name
        folder.mkdir()
        kwargs = {"launcher": launcher} if launcher else {}
        proc = run_cli(*args, env=cli_env(tmp_path), cwd=folder, name=name, **kwargs)
        assert proc.wait(300) == 0, proc.output
        runs[name] = _normalized(proc.output.replace(f"voice-{name}", "voice-<name>"), str(folder))
    command, api = runs["command"], runs["api"]
    assert "run voice: FINISHED" in command and any(line.startswith("  library log:") for line in command), command
    assert api[-1] == AFTER, api  # the script's logging is back once the call has returned
    extra = [line for line in api[:-1] if line not in command]
    assert not extra, "printed by raylane.train() and not by `raylane train`:\n" + "\n".join(extra)
    # The outcome block, every line of it.
    assert [ln for ln in api if ln.startswith("  ")] == [ln for ln in command if ln.startswith("  ")]
