"""The config edge end to end: `raylane train` rejects a bad value with one line, before Ray or
torch starts (the config's own checks are unit tests: tests/unit/test_config.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

DIGITS = REPO / "pipelines" / "digits.yaml"


def test_train_rejects_bad_batch_size_before_ray_or_torch_starts(tmp_path):
    # A fresh interpreter: the rejection must come before Ray or torch.distributed are imported.
    code = (
        "import sys; from raylane.cli import main\n"
        f"rc = main(['train', {str(DIGITS)!r}, '--set', 'train.batch_size=-1'])\n"
        "loaded = [m for m in ('ray', 'torch.distributed', 'mlflow') if m in sys.modules]\n"
        "print('LOADED', loaded, file=sys.stderr); sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "raylane: invalid config: train.batch_size = -1: Input should be greater than or equal to 1"
    assert lines[1] == "LOADED []"
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


# -- property-based: random YAML documents and overrides ------------------------------------------
