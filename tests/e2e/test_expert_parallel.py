"""Expert parallelism at ep 2 on 2 ranks under torchrun (gloo, CPU) against one process (issue
65's Done-when, its core: raylane.loop.distributed.expert_parallel called directly, not yet
through strategy.ep): a tiny Qwen2-MoE with its shared expert and a tiny Mixtral, 4 experts, top-2,
the dense part under DDP. One torchrun runs every case (tests/helpers/ep_ranks.py)."""

from __future__ import annotations

import os

import pytest

from tests.conftest import REPO, TORCHRUN, cli_env, read_json

pytest.importorskip("transformers")

STEPS = 10


def test_ep2_matches_one_process_loss_gradients_tokens_and_checkpoint(run_cli, tmp_path):
    """Each family, 10 AdamW steps: the loss (mean of the ranks') and every gradient (expert
    shards gathered) within 1e-5 of the one process's full batch at every step, the parameters
    after them too; the tokens per expert summed over the ranks equal the one process's routing;
    each rank holds half the experts' parameters. A router collapsed onto rank 1's experts (every
    token to experts 2 and 3: rank 0 receives nothing) neither hangs nor drops a token, and its
    gradients still match (rank 0's idle experts get the zero gradient one process gives them).
    The ep 2 checkpoint (DCP) reads back whole, exactly."""
    out = tmp_path / "out"
    out.mkdir()
    p = run_cli(
        *["--nproc_per_node", "2", str(REPO / "tests/helpers/ep_ranks.py"), str(out), str(STEPS)],
        launcher=TORCHRUN,
        name="ep2",
        env=cli_env(tmp_path, PYTHONPATH=os.pathsep.join([str(REPO / "app"), str(REPO)]), OMP_NUM_THREADS="1"),
    )
    assert p.wait(240) == 0, p.output
    for rank in (0, 1):
        results = read_json(out / f"rank{rank}.json")
        for case in ("qwen2_moe", "mixtral", "qwen2_moe biased", "mixtral biased"):
            r = results[case]
            assert r["laid"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], (case, r)
            assert r["held"] * 2 == r["whole"] > 0, (case, r)
            assert r["loss_gap"] <= 1e-5 and r["grad_gap"] <= 1e-5 and r["param_gap"] <= 1e-5, (case, rank, r)
            assert r["load_gap"] == 0, (case, r)
            pairs = [sum(layer) for layer in r["last_counts"]]
            assert pairs == [4 * 8 * 2] * 2, (case, r)  # every (token, choice) pair of the batch
            if case.endswith("biased"):
                assert all(layer[:2] == [0, 0] for layer in r["last_counts"]), (case, r)
            else:
                assert all(min(layer) > 0 for layer in r["last_counts"]), (case, r)
        assert results["qwen2_moe"]["ckpt_gap"] == 0.0, results["qwen2_moe"]
