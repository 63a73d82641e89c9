"""Checkpoints on `s3://` (pyarrow's S3 filesystem), against a real S3-compatible server on
loopback: written by a run on 2 Ray workers of a joined cluster (the test suite's head), which get
the endpoint and the keys as a user hands them on, by name in the config's `env:` (the head's own
environment has none of them), committed and pruned there, and resumed from there by the same run
relaunched under torchrun (storage is the same for every launcher; torchrun also starts in a third
of Ray's time)."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from raylane.loop import checkpoint
from tests.conftest import TORCHRUN, cli_env, read_json

# Nothing of MLflow is checked here (the same run continuing across launches: test_records, test_resume).
pytestmark = [pytest.mark.ray, pytest.mark.shared_ray, pytest.mark.untracked]


def test_checkpoints_on_s3_and_resume_from_there(run_cli, tmp_path, s3_endpoint):
    env = cli_env(tmp_path, **s3_endpoint)
    handed_on = [x for name in s3_endpoint for x in ("--set", f"env.{name}=${{{name}}}")]
    args = [
        "train",
        "regression",
        "--set",
        "run.name=s3run",
        "--set",
        "run.storage_path=s3://raylane/runs",
        "--set",
        "checkpoint.every_n_steps=10",
        "--set",
        "checkpoint.keep=2",
    ]
    first = run_cli(*args, *handed_on, "--set", "train.max_steps=30", "--summary-json", "a.json", env=env, name="first")
    assert first.wait(300) == 0, first.output
    a = read_json(tmp_path / "a.json")
    assert a["status"] == "FINISHED" and a["steps"] == 30

    fs = pafs.S3FileSystem(
        endpoint_override=s3_endpoint["AWS_ENDPOINT_URL"],
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
    )
    stored = checkpoint.committed("raylane/runs/s3run", fs)
    assert [p.rsplit("/", 1)[1] for p in stored] == [checkpoint.checkpoint_name(s) for s in (20, 30)]
    assert checkpoint.verify(stored[-1], fs) is None  # every rank's shard, checksummed, in the bucket
    assert not (tmp_path / "runs").exists()  # nothing went to local disk instead

    again = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        *args,
        "--set",
        "train.max_steps=50",
        "--summary-json",
        "b.json",
        env=env,
        name="again",
        launcher=TORCHRUN,
    )
    assert again.wait(300) == 0, again.output
    b = read_json(tmp_path / "b.json")
    assert b["resumed_from_step"] == 30 and b["steps"] == 50
