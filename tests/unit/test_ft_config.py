"""The `fault_tolerance:` section and its checks before launch (issue 62): what the config alone
can refuse (raylane.config.base) and what the launch's preparation refuses (where the run would
run, torchft installed: raylane.layout_checks). The command line's lines for each are
tests/e2e/test_bad_input.py's table."""

from __future__ import annotations

import importlib.util

import pytest

from raylane import layout_checks
from raylane.config import ConfigError, load_config


def ft(*sets: str):
    return load_config("digits", ["fault_tolerance.enabled=true", *sets])


def test_groups_split_the_world_and_pick_their_process_group():
    cfg = ft("scaling.num_workers=6", "fault_tolerance.replica_groups=3")
    assert cfg.fault_tolerance.group_size(cfg.scaling.num_workers) == 2
    assert layout_checks.layout_world(cfg) == (
        2,
        "a replica group's 2 workers (scaling.num_workers = 6 / fault_tolerance.replica_groups)",
    )
    assert cfg.fault_tolerance.pg_backend(use_gpu=False) == "gloo"
    assert cfg.fault_tolerance.pg_backend(use_gpu=True) == "nccl"
    off = load_config("digits", ["scaling.num_workers=6"])
    assert layout_checks.layout_world(off) == (6, "scaling.num_workers = 6")  # without groups: the world's


@pytest.mark.parametrize(
    "sets, line",
    [
        (["scaling.num_workers=5"], "fault_tolerance.replica_groups = 2: does not divide scaling.num_workers = 5"),
        (
            ["fault_tolerance.min_replicas=3"],
            "fault_tolerance.min_replicas = 3: above fault_tolerance.replica_groups = 2",
        ),
        (["fault_tolerance.process_group=nccl"], "fault_tolerance.process_group = 'nccl' with fault_tolerance.enabled"),
        (["fault_tolerance.semi_sync.method=adam"], "fault_tolerance.semi_sync.method = 'adam'"),
        (["fault_tolerance.heartbeat_timeout_s=0"], "fault_tolerance.heartbeat_timeout_s = 0"),
    ],
)
def test_the_config_alone_refuses_by_the_key(sets, line):
    world = [] if sets[0].startswith("scaling.") else ["scaling.num_workers=2"]
    with pytest.raises(ConfigError) as raised:
        ft(*world, *sets)
    assert line in str(raised.value) and "\n" not in str(raised.value)


def test_semi_sync_runs_with_replica_groups():
    """local_sgd and diloco pass the checks before launch (raylane.loop.distributed.ft_semisync runs them)."""
    for method in ("local_sgd", "diloco"):
        cfg = ft("scaling.num_workers=2", f"fault_tolerance.semi_sync.method={method}")
        assert cfg.fault_tolerance.semi_sync.method == method


def test_a_disabled_section_asks_nothing_of_the_rest():
    cfg = load_config("digits", ["scaling.num_workers=3", "fault_tolerance.replica_groups=2"])
    assert not cfg.fault_tolerance.enabled  # 3 workers do not split in 2: no matter, groups are off
    layout_checks.check_replica_groups(cfg, "the one process of --local")


def test_where_and_with_what_replica_groups_run(monkeypatch):
    cfg = ft("scaling.num_workers=2")
    layout_checks.check_replica_groups(cfg, None)  # on Ray, with torchft installed (make install's dev extra)
    with pytest.raises(ConfigError, match="with torchrun's WORLD_SIZE = 2: replica groups need a launcher"):
        layout_checks.check_replica_groups(cfg, "torchrun's WORLD_SIZE = 2")
    # torchft not installed: mocked by its lookup (it cannot be uninstalled from the shared venv here)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ConfigError) as raised:
        layout_checks.check_replica_groups(cfg, None)
    assert str(raised.value) == (
        "fault_tolerance.enabled: needs torchft, which is not installed here; "
        "pip install 'raylane[fault-tolerance]' (x86-64 Linux)"
    )


@pytest.mark.parametrize("name", ["TORCHFT_LIGHTHOUSE", "RAYLANE_REPLICA_GROUP", "RAYLANE_REPLICA_GROUPS"])
def test_the_launchers_replica_variables_are_not_the_configs(name):
    with pytest.raises(ConfigError, match=f"env.{name} = 'x': set by the launcher for each rank"):
        load_config("digits", [f"env.{name}=x"])


def test_sweep_and_search_records_from_before_the_section_still_match(tmp_path):
    """A sweep or an autotune search recorded before `fault_tolerance:` existed continues or
    replays: neither compares the section's keys (neither runs replica groups). Before, a sweep
    rerun failed with 'fault_tolerance.enabled = False: sweep ... already ran with
    fault_tolerance.enabled = (not set)', and test_autotune_types' stored record stopped
    replaying."""
    from raylane.config.sweep import load_sweep
    from raylane.sweeps.record import settings

    (tmp_path / "s.yaml").write_text("sweep: {name: s, base: digits, space: {optim.lr: {grid: [0.1]}}}\n")
    sweep, base = load_sweep(str(tmp_path / "s.yaml"))
    recorded = settings(sweep, base)
    assert recorded and not [k for k in recorded if k.startswith("fault_tolerance.")]
