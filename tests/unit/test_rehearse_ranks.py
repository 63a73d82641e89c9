"""`raylane check --world`'s shares measured against real ranks: the same small gpt laid out by
raylane's parallelize on 4 gloo ranks under torchrun (tests/helpers/rehearse_ranks.py, weights on
the CPU) and rehearsed at 256 ranks on the fake process group (raylane.loop.rehearsal): each
played rank's parameter bytes are the 4-rank ones scaled by the FSDP shards' ratio, within 1%.
One launch covers the three layouts: start-up is most of its ~30 s."""

from __future__ import annotations

import pytest

from raylane.config import load_config
from raylane.loop.rehearsal import Target, rehearse
from tests.conftest import REPO, TORCHRUN, cli_env, read_json
from tests.helpers.rehearse_ranks import MODEL

HELPER = str(REPO / "tests/helpers/rehearse_ranks.py")
LAYOUTS = {
    "fsdp": "",
    "fsdp_tp2": "strategy.tp=2",
    "fsdp_tp2_pp2": "strategy.tp=2,strategy.pp=2",
}


def test_rehearsed_shares_at_256_are_four_real_ranks_scaled_by_the_shards(run_cli, tmp_path):
    p = run_cli(
        "--nproc_per_node",
        "4",
        HELPER,
        *(f"{name}:{sets}" for name, sets in LAYOUTS.items()),
        launcher=TORCHRUN,
        env=cli_env(tmp_path, REHEARSE_OUT=str(tmp_path / "out.json"), OMP_NUM_THREADS="1"),
    )
    assert p.wait(300) == 0, p.output
    real = read_json(tmp_path / "out.json")
    for name, sets in LAYOUTS.items():
        cfg = load_config("gpt-tiny", [*MODEL, *(s for s in sets.split(",") if s)])
        shares = {s.rank: s for s in rehearse(cfg, Target(256, 1, "H100")).shares}
        layout = shares[0].layout
        assert layout.world_size == 256 and layout.dp_shard == 256 // (layout.tp * layout.pp), (name, layout)
        scale = real[name]["dp_shard"] / layout.dp_shard  # each rank's rows of every parameter
        pairs = [(0, 0)]  # (rank at 4, rank at 256): rank 0, and the last stage's first rank
        if layout.pp > 1:
            pairs.append((4 // layout.pp * (layout.pp - 1), 256 // layout.pp * (layout.pp - 1)))
        for at_4, at_256 in pairs:
            expected = real[name]["bytes"][at_4] * scale
            assert shares[at_256].param_bytes == pytest.approx(expected, rel=0.01), (name, at_4, at_256)
        # the last shard of each stage was played too, and holds as much (every dim 0 divides 256)
        assert len(shares) == 2 * len(pairs), (name, sorted(shares))
