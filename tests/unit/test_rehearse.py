"""`raylane check CONFIG --world N [--nodes M] [--gpu MODEL]` (raylane.loop.rehearsal): what fails
only at full size exits 2 in one line naming the key, and passes at a small world where it should;
the 7B-shaped gpt at 256 ranks on 32 nodes of H100s prints each played rank's memory."""

from __future__ import annotations

import pytest

from raylane.cli import main
from raylane.loop.distributed.layout import Layout
from raylane.loop.rehearsal.target import Target, mesh_line, nodes_spanned
from tests.conftest import REPO

PP = ["strategy.name=fsdp", "model.tie_embeddings=false", "model.n_layer=4"]
# gpt 1.6B (2048 wide, 32 blocks): 24 GiB of parameters, gradients and AdamW state whole, 3 GiB in 8 shards
BIG = ["strategy.name=fsdp", "model.n_embd=2048", "model.n_layer=32", "model.n_head=16"]

# (the key the line names, the flags that fail, the flags that pass, --set overrides)
FULL_SIZE_ONLY = [
    ("strategy.pp = 2 x strategy.tp = 2: 4 ranks do not divide --world 6", ["--world", "6"], ["--world", "8"],
     [*PP, "strategy.tp=2", "strategy.pp=2"]),
    ("strategy.dp_replicate = 3: 3 ranks do not divide --world 256", ["--world", "256"], ["--world", "6"],
     ["strategy.name=fsdp", "strategy.dp_replicate=3"]),
    ("strategy.tp = 4: a tensor-parallel group would span 2 nodes at --world 8 --nodes 4",
     ["--world", "8", "--nodes", "4"], ["--world", "8", "--nodes", "2"], ["strategy.name=fsdp", "strategy.tp=4", "model.n_head=4"]),
    ("train.global_batch = 48: not a multiple of train.batch_size = 1 x --world 32", ["--world", "32"],
     ["--world", "16"], ["train.global_batch=48", "train.batch_size=1"]),
    ("at --world 64: invalid config: strategy.pp_microbatches = 4: does not divide train.batch_size = 2",
     ["--world", "64"], ["--world", "4"],
     [*PP, "strategy.pp=2", "strategy.pp_microbatches=4", "train.global_batch=64", "train.global_batch_adjust=batch_size"]),
    ("--gpu L4: rank 0 would need ~35.2 GiB of its 24.0 GiB under hsdp at --world 16 --nodes 16",
     ["--world", "16", "--nodes", "16", "--gpu", "L4"], ["--world", "16", "--nodes", "2", "--gpu", "L4"], BIG),
]  # fmt: skip


def _check(capsys, flags: list[str], sets: list[str]) -> tuple[int, str, str]:
    argv = ["check", "gpt-tiny", *flags]
    for s in sets:
        argv += ["--set", s]
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(("line", "fails", "passes", "sets"), FULL_SIZE_ONLY, ids=lambda v: None)
def test_what_fails_only_at_full_size_exits_2_in_one_line(capsys, line, fails, passes, sets):
    code, out, err = _check(capsys, fails, sets)
    assert code == 2, out + err
    assert err.startswith(f"raylane: {line}") and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    code, out, err = _check(capsys, passes, sets)
    assert code == 0, out + err
    assert "per rank (" in out and "\n  rank 0" in out, out


def test_the_flags_are_checked_before_the_config(capsys):
    for flags, line in (
        (["--world", "16", "--nodes", "3"], "--nodes = 3: does not divide --world 16"),
        (["--world", "16", "--gpu", "X9"], "--gpu = 'X9': not a GPU raylane's table knows"),
        (["--nodes", "2"], "--nodes: rehearses a run of --world N ranks"),
    ):
        code, _, err = _check(capsys, flags, [])
        assert code == 2 and err.startswith(f"raylane: {line}") and err.count("\n") == 1, err


def test_which_dimension_crosses_nodes():
    """pp outermost, tp innermost (torchtitan's order): 256 ranks on 32 nodes of 8."""
    target = Target(256, 32, "H100")
    layout = Layout("fsdp", pp=4, dp_shard=8, tp=8)
    assert mesh_line(layout, target) == "pp 4 across 4 nodes; dp_shard 8 across 8 nodes; tp 8 within a node"
    assert mesh_line(Layout("hsdp", dp_replicate=32, dp_shard=8), target) == (
        "dp_replicate 32 across 32 nodes; dp_shard 8 within a node"
    )
    assert nodes_spanned(4, 1, 6) == 1 and nodes_spanned(16, 1, 8) == 2


GPT_7B = [
    "model.n_embd=4096",
    "model.n_layer=32",
    "model.n_head=32",
    "model.vocab_size=32000",
    "model.block_size=4096",
    "model.tie_embeddings=false",
    "model.bias=false",
    "train.precision=bf16",
    "train.batch_size=1",
    "strategy.name=fsdp",
]


def _rehearse_7b(run_cli, *sets: str) -> str:
    args = ["check", "gpt-tiny", "--world", "256", "--nodes", "32", "--gpu", "H100"]
    for s in [*GPT_7B, *sets]:
        args += ["--set", s]
    p = run_cli(*args)
    assert p.wait(300) == 0, p.output
    return p.output


def test_a_7b_gpt_at_256_ranks_on_32_nodes_of_h100s(run_cli):
    """FSDP x TP8: every rank holds 1/256 of the 6.72B parameters (102 MiB in fp32) and the same."""
    out = _rehearse_7b(run_cli, "strategy.tp=8")
    assert "layout: fsdp×tp8 (dp_shard 32, tp 8): dp_shard 32 across 32 nodes; tp 8 within a node" in out, out
    assert "model: GPT, 6.72B parameters (25.0 GiB)" in out, out
    ranks = [line for line in out.splitlines() if line.startswith("  rank ")]
    assert [r.split(":")[0] for r in ranks] == ["  rank 0", "  rank 248"], out
    assert all("of 80.0 GiB" in r and "parameters 102 MiB, gradients 102 MiB, optimizer 204 MiB" in r for r in ranks)
    assert "batch: 32 samples per step" in out and "131,072 tokens" in out, out
    assert "checkpoint: 514 files per save" in out, out
    assert "the same at 2 ranks: none per rank" in out, out
    # 32 nodes: MLflow's health is figures over the nodes, as the driver records past 8 of them.
    assert "system/nodes/* over the 32 nodes (min, median, max)" in out, out


def test_the_rehearsal_names_the_drivers_limit_on_node_series():
    from raylane.loop.rehearsal import NODE_SERIES
    from raylane.tracking.health import MAX_NODE_SERIES

    assert NODE_SERIES == MAX_NODE_SERIES


def test_a_7b_gpt_under_fsdp_and_pp4_x_fsdp_x_tp8(run_cli):
    """FSDP at 32 nodes is HSDP: 8 shards per node, replicated over the nodes; PP4 x FSDP x TP8
    holds the embeddings on stage 0 and the head on stage 3."""
    out = _rehearse_7b(run_cli)
    assert "layout: hsdp (256 data-parallel ranks): dp_replicate 32 across 32 nodes; dp_shard 8 within a node" in out
    assert "  rank 0: " in out and "parameters 3.13 GiB, gradients 3.13 GiB, optimizer 6.26 GiB" in out, out
    out = _rehearse_7b(run_cli, "strategy.tp=8", "strategy.pp=4", "train.batch_size=4")
    assert "pp 4 across 4 nodes; dp_shard 8 across 8 nodes; tp 8 within a node" in out, out
    stages = {line.split(":")[0]: line for line in out.splitlines() if line.startswith("  rank ")}
    assert list(stages) == ["  rank 0 (stage 0)", "  rank 56 (stage 0)", "  rank 192 (stage 3)", "  rank 248 (stage 3)"]
    assert (
        "parameters 112 MiB" in stages["  rank 0 (stage 0)"] and "parameters 104 MiB" in stages["  rank 192 (stage 3)"]
    )


@pytest.mark.slow
def test_hugging_face_configs_without_weights_at_256_ranks(run_cli, tmp_path):
    """Llama-2-7B's and Mixtral-8x7B's config.json alone (examples/rehearse: transformers'
    from_config on the meta device). Mixtral under FSDP over 32 nodes of 8 is refused: HSDP's 8
    shards leave each rank 87 GiB of parameters, gradients and AdamW state; under PP4 x FSDP,
    FSDP x TP8 and PP4 x FSDP x TP8 it fits."""
    import sys

    sys.path.insert(0, str(REPO / "examples/rehearse"))
    from make_configs import write

    folders = write(tmp_path)
    args = ["check", str(REPO / "examples/rehearse/llama.yaml"), "--world", "256", "--nodes", "32", "--gpu", "H100"]
    p = run_cli(*args, "--set", f"model.config_dir={folders['llama-2-7b']}", "--set", "strategy.tp=8")
    assert p.wait(300) == 0, p.output
    assert "model: LlamaForCausalLM, 6.74B parameters" in p.output and "parameters 100 MiB" in p.output, p.output
    mixtral = [*args, "--set", f"model.config_dir={folders['mixtral-8x7b']}"]
    mixtral[1] = str(REPO / "examples/rehearse/mixtral.yaml")
    p = run_cli(*mixtral)
    assert p.wait(300) == 2, p.output
    assert "raylane: --gpu H100: rank 0 would need ~92.4 GiB of its 80.0 GiB under hsdp" in p.output, p.output
    # Its 8 experts over 64 shards: split on dim 1 (FSDP2's dim 0 left ranks 8-63 of each stage
    # 16.0 GiB of padding and a warning), whole on each rank of a tensor-parallel group.
    p = run_cli(*mixtral, "--set", "strategy.pp=4", "--set", "train.batch_size=4")
    assert p.wait(300) == 0, p.output
    assert "  rank 63 (stage 0): 8.14 GiB" in p.output and "warning: uneven shards" not in p.output, p.output
    p = run_cli(*mixtral, "--set", "strategy.tp=8")  # 84.8 GiB a rank with dim 0's split: refused
    assert p.wait(300) == 0, p.output
    assert "layout: fsdp×tp8 (dp_shard 32, tp 8)" in p.output and "  rank 248: 21.8 GiB" in p.output, p.output
    p = run_cli(*mixtral, "--set", "strategy.tp=8", "--set", "strategy.pp=4", "--set", "train.batch_size=4")
    assert p.wait(300) == 0, p.output
    assert "  rank 0 (stage 0): 21.8 GiB" in p.output and "  rank 248 (stage 3): 21.8 GiB" in p.output, p.output


def test_every_played_rank_takes_rank_0s_auto_choice():
    """On the ranks, rank 0's `auto` choice is broadcast; played on the fake group, rank 12 (the
    last shard) measured its own, smaller shard and chose FSDP alone where rank 0 chose tp 4."""
    from raylane.config import load_config
    from raylane.loop.rehearsal import rehearse

    sets = ["strategy.name=fsdp", "strategy.tp=auto", "model.n_head=4", "scaling.device_memory_gb=0.001"]
    shares = rehearse(load_config("gpt-tiny", sets), Target(16, 2, "H100")).shares
    assert [s.rank for s in shares] == [0, 12]
    assert [s.layout.label() for s in shares] == ["fsdp×tp4", "fsdp×tp4"]
