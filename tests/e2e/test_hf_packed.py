"""A packed batch on 2 ranks under FSDP2 (issue 64's Done-when, the 2-rank half; one process:
tests/unit/test_hf_packing.py): each rank's share of the examples packed has the loss of the same
share one a row, padded, and after FSDP's reduce-scatter the same gradient shards, within 1e-5
(fp32, a tiny Llama and a tiny Qwen2, one torchrun each); without the document mask both are off."""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO, TORCHRUN, cli_env, read_json

pytest.importorskip("transformers")


# Slow (a torchrun of 2 ranks each, ~35 s): make test proves the same in one process
# (tests/unit/test_hf_packing.py) and its 15 minutes are spent.
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_rows_on_2_fsdp_ranks_match_the_same_examples_one_a_row(run_cli, tmp_path, family):
    (tmp_path / "out").mkdir()
    p = run_cli(
        *["--nproc_per_node", "2", str(REPO / "tests/helpers/hf_packed_ranks.py"), family, str(tmp_path / "out")],
        launcher=TORCHRUN,
        name=f"packed-{family}",
        env=cli_env(tmp_path, PYTHONPATH=os.pathsep.join([str(REPO / "app"), str(REPO)]), OMP_NUM_THREADS="1"),
    )
    assert p.wait(300) == 0, p.output
    for rank in (0, 1):
        r = read_json(tmp_path / "out" / f"rank{rank}.json")
        packed_rows, padded_rows = r["rows"]
        assert packed_rows < padded_rows, r  # several documents a row
        loss, ref, crossed = r["losses"]
        assert abs(loss - ref) <= 1e-5 and r["grad_gap"] <= 1e-5, (rank, r)
        assert abs(crossed - ref) > 1e-4 and r["unmasked_grad_gap"] > 1e-4, (rank, r)
