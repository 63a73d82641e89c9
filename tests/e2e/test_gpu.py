"""GPU checks: skipped without CUDA (`make test` deselects them; run `pytest -m gpu` on a GPU)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_gpu_check_script_reports_tokens_mfu_and_memory(tmp_path):
    env = dict(os.environ, STEPS="20", NPROC="1", OUT=str(tmp_path))
    out = subprocess.run(
        ["bash", str(REPO / "scripts/gpu-check.sh")], env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    s = json.loads((tmp_path / "gpu-check.json").read_text())
    assert s["status"] == "FINISHED" and s["steps"] == 20
    assert s["tokens_per_s"] > 0 and s["memory"]["peak_bytes"] > 0
    assert "MFU:" in out.stdout
