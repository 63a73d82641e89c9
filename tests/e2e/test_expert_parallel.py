"""Expert parallelism at ep 2 on 2 ranks under torchrun (gloo, CPU) against one process (issue
65's Done-when, its core: raylane.loop.distributed.expert_parallel called directly, not yet
through strategy.ep): a tiny Qwen2-MoE with its shared expert and a tiny Mixtral, 4 experts, top-2,
the dense part under DDP. One torchrun runs every case (tests/helpers/ep_ranks.py)."""

from __future__ import annotations

import os
import shutil

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
        # A capacity of 1 at ep 2 with every pair sent to rank 1's experts: each rank's 16 tokens
        # x 2 choices give experts 2 and 3 16 pairs each, 8 (ceil(32 / 4)) kept. The loss is one
        # process's with the dropped pairs' weights 0; rank 0's window and both ranks' summary.
        capped = results["capped"]
        assert capped["loss_gap"] <= 1e-5, capped
        window = {k: v for k, v in capped["window"].items() if k != "experts/all_to_all_share"}
        assert window == {
            "experts/tokens_min": 0.0,
            "experts/tokens_max": 16.0,
            "experts/imbalance": 2.0,
            "experts/dropped_tokens": 32.0,  # 8 a expert, 2 experts, 2 layers
        }, capped
        assert 0 < capped["window"]["experts/all_to_all_share"] <= 1
        summary = capped["summary"]
        assert (summary["routed"], summary["tokens_max"], summary["dropped"], summary["ep"]) == (128, 32, 64, 2)


@pytest.mark.slow  # ~25 s alone on 2 cores, 42 s loaded: the whole run and MLflow
def test_a_router_biased_to_one_ranks_experts_is_in_mlflow_and_the_summary_with_its_drops(run_cli, tmp_path):
    """`raylane train` under torchrun, 2 ranks, strategy.ep 2 with a capacity factor of 1, the own
    MoE's routers biased so that every token picks experts 0 and 1 (both rank 0's): nothing hangs;
    each window's train/experts/* say rank 0's routing (experts 2 and 3 idle, imbalance 4 / 2 = 2)
    and its drops (each rank sends an expert at most ceil(64 x 2 / 4) = 32 of its 64 pairs a
    forward: 32 of 64 dropped per expert, 128 a step over 2 layers); the summary says every rank's:
    4 steps x 2 ranks x 128 pairs a layer, half dropped."""
    from mlflow.tracking import MlflowClient

    shutil.copy(REPO / "tests/helpers/moe_own.py", tmp_path / "moe_own.py")
    (tmp_path / "ep.yaml").write_text(
        "pipeline: ./moe_own.py\nmodel: {bias_router: true}\n"
        "strategy: {name: ddp, ep: 2, ep_capacity_factor: 1.0}\n"
        "train: {max_steps: 4, batch_size: 8, seed: 3}\ncheckpoint: {every_n_steps: 0}\n"
        f"mlflow: {{log_every_n_steps: 2, log_model: false, system_metrics: false}}\nrun: {{storage_path: {tmp_path}/runs}}\n"
    )
    p = run_cli(
        *["--nproc_per_node", "2", "-m", "raylane", "train", "ep.yaml", "--summary-json", "s.json"],
        launcher=TORCHRUN,
        name="ep2-biased",
        env=cli_env(tmp_path, PYTHONPATH=str(REPO / "app"), OMP_NUM_THREADS="1"),
    )
    assert p.wait(240) == 0, p.output
    s = read_json(tmp_path / "s.json")
    assert s["experts"] == {
        "modules": 2,
        "experts": 4,
        "ep": 2,
        "capacity_factor": 1.0,
        "routed": 4 * 2 * 2 * 128,
        "tokens_min": 0,
        "tokens_max": 4 * 2 * 64,
        "imbalance": 2.0,
        "dropped": 4 * 2 * 2 * 64,
    }
    assert (
        "experts:       2 modules x 4 experts, ep2; tokens per expert min 0 max 512 (imbalance 2.00x), 1,024 of"
        in p.output
    )
    client = MlflowClient(s["tracking_uri"])
    history = {
        name: [(m.step, m.value) for m in client.get_metric_history(s["run_id"], f"train/experts/{name}")]
        for name in ("tokens_min", "tokens_max", "imbalance", "dropped_tokens")
    }
    assert history == {
        "tokens_min": [(2, 0.0), (4, 0.0)],
        "tokens_max": [(2, 128.0), (4, 128.0)],  # rank 0's 64 tokens a step, 2 steps
        "imbalance": [(2, 2.0), (4, 2.0)],
        "dropped_tokens": [(2, 256.0), (4, 256.0)],
    }
    shares = [m.value for m in client.get_metric_history(s["run_id"], "train/experts/all_to_all_share")]
    assert len(shares) == 2 and all(0 < v <= 1 for v in shares), shares
