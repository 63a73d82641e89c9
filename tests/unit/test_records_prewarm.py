"""A Ray driver pays the end-of-run records' imports while its workers train
(raylane.tracking.records._import_record_modules): only those its run's end will use."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

PROBE = """
import sys
from raylane.tracking.records import _import_record_modules
_import_record_modules({model})
print("matplotlib.pyplot" in sys.modules, "mlflow.pytorch" in sys.modules)
"""


def test_a_run_that_logs_no_model_does_not_prewarm_the_model_export():
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(model=False)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["True", "False"], out.stdout + out.stderr  # the plots' imports, not the model's
