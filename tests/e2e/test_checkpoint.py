"""Checkpoints are committed by a manifest; a corrupt newest one falls back to the previous."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from raylane.loop import checkpoint
from tests.conftest import read_json

pytestmark = pytest.mark.untracked


def _save(root: Path, step: int, value: float) -> Path:
    model = torch.nn.Linear(4, 2)
    torch.nn.init.constant_(model.weight, value)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = root / checkpoint.checkpoint_name(step)
    path.mkdir(parents=True)
    checkpoint.save(path, model, optimizer, {"step": step}, rank=0)
    return path


def _shard(path: Path) -> Path:
    return path / checkpoint.STATE_FILE  # a replicated state: rank 0's one file


def test_manifest_lists_every_file_with_its_checksum(tmp_path):
    path = _save(tmp_path, 10, 1.0)
    manifest = checkpoint.read_manifest(path)
    assert manifest["train_state"] == {"step": 10}
    assert set(manifest["files"]) == {"state.pt"}
    assert checkpoint.verify(str(path)) is None


def test_truncated_bitflipped_or_uncommitted_checkpoints_are_skipped(tmp_path):
    good = _save(tmp_path, 10, 1.0)
    truncated = _save(tmp_path, 20, 2.0)
    flipped = _save(tmp_path, 30, 3.0)
    uncommitted = _save(tmp_path, 40, 4.0)
    (uncommitted / checkpoint.MANIFEST_FILE).unlink()  # as if the writer died before the commit
    shard = _shard(truncated)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-7])
    data = bytearray(_shard(flipped).read_bytes())
    data[len(data) // 2] ^= 0x01
    _shard(flipped).write_bytes(bytes(data))

    assert checkpoint.verify(str(truncated)) == f"state.pt has {size - 7} bytes, the manifest says {size}"
    assert "does not match its checksum" in checkpoint.verify(str(flipped))
    assert checkpoint.latest_valid(str(tmp_path)) == str(good)

    model = torch.nn.Linear(4, 2)
    state = checkpoint.load(good, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert state == {"step": 10} and torch.all(model.weight == 1.0)


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, float(step))
    checkpoint.prune(str(tmp_path), keep=2)
    assert [Path(p).name for p in checkpoint.committed(str(tmp_path))] == [
        checkpoint.checkpoint_name(3),
        checkpoint.checkpoint_name(4),
    ]


@pytest.mark.slow  # ~9 s; make test relaunches past a damaged newest checkpoint, saying so once (test_resume:
# test_a_resume_past_a_damaged_checkpoint_says_so_...) and finds a truncated one (the first test here)
def test_relaunch_after_a_truncated_latest_checkpoint_uses_the_previous(run_cli, tmp_path):
    args = ["train", "regression", "--local", "--set", "run.name=t", "--set", "checkpoint.every_n_steps=10"]
    first = run_cli(*args, "--set", "train.max_steps=30", "--summary-json", "a.json")
    assert first.wait(120) == 0, first.output
    latest = Path(read_json(tmp_path / "a.json")["checkpoint"])
    assert latest.name == checkpoint.checkpoint_name(30)
    shard = _shard(latest)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])

    again = run_cli(*args, "--set", "train.max_steps=40", "--summary-json", "b.json")
    assert again.wait(120) == 0, again.output
    b = read_json(tmp_path / "b.json")
    assert b["resumed_from_step"] == 20 and b["steps"] == 40
    line = (
        f"checkpoint_000000030 skipped: state.pt has {size // 2} bytes, the manifest says {size}; "
        "resuming from checkpoint_000000020"
    )
    assert again.output.count(line) == 1, again.output


def test_keep_limits_checkpoints_on_disk(run_cli, tmp_path):
    proc = run_cli(
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=k",
        "--set",
        "checkpoint.every_n_steps=5",
        "--set",
        "checkpoint.keep=2",
        "--set",
        "train.max_steps=30",
        "--summary-json",
        "s.json",
    )
    assert proc.wait(120) == 0, proc.output
    names = sorted(p.name for p in (tmp_path / "runs" / "k").glob("checkpoint_*"))
    assert names == [checkpoint.checkpoint_name(25), checkpoint.checkpoint_name(30)]
    assert json.loads((tmp_path / "runs/k" / names[-1] / "manifest.json").read_text())["train_state"]["step"] == 30
    # Saves at steps 5-25 held the loop up (B7 measures this); the end-of-run save is not counted.
    summary = json.loads((tmp_path / "s.json").read_text())
    assert 0 < summary["checkpoint_stall_s"] < summary["wall_s"] and summary["train_cpu_s"] > 0


def test_resume_with_dropout_is_bit_exact(run_cli, tmp_path):
    """Dropout draws from torch's generator: resuming must restore it, not just the weights."""
    args = [
        "train",
        "digits",
        "--local",
        "--set",
        "scaling.num_workers=1",
        "--set",
        "model.dropout=0.3",
        "--set",
        "checkpoint.every_n_steps=10",
    ]
    first = run_cli(*args, "--set", "run.name=r", "--set", "train.max_steps=30", "--summary-json", "a.json")
    assert first.wait(120) == 0, first.output
    again = run_cli(*args, "--set", "run.name=r", "--set", "train.max_steps=60", "--summary-json", "b.json")
    straight = run_cli(*args, "--set", "run.name=s", "--set", "train.max_steps=60", "--summary-json", "c.json")
    assert again.wait(120) == 0 and straight.wait(120) == 0
    b, c = read_json(tmp_path / "b.json"), read_json(tmp_path / "c.json")
    assert b["resumed_from_step"] == 30
    from raylane.config import load_config
    from raylane.loop.run import build_optimizer
    from raylane.pipelines.digits import build_model

    cfg = load_config("digits", ["model.dropout=0.3"])
    weights = []
    for summary in (b, c):
        model = build_model(cfg.model)
        checkpoint.load(summary["checkpoint"], model, build_optimizer(model, cfg))
        weights.append(model.state_dict())
    for name in weights[1]:
        assert torch.equal(weights[0][name], weights[1][name]), name


@pytest.mark.slow  # ~13 s; make test exports a trained checkpoint, its summary and a numpy-only load included
# (test_aliases: test_export_of_the_tied_model_writes_each_tensor_once_and_loads_back); a DDP checkpoint is rank 0's one file
def test_export_from_two_rank_checkpoint_loads_with_safetensors_alone(run_cli, tmp_path):
    from tests.conftest import TORCHRUN

    proc = run_cli(
        "--nproc_per_node",
        "2",
        "-m",
        "raylane",
        "train",
        "digits",
        "--set",
        "run.name=e",
        "--set",
        "train.max_epochs=1",
        "--summary-json",
        "s.json",
        launcher=TORCHRUN,
    )
    assert proc.wait(180) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    out = run_cli("export", s["checkpoint"], "--out", "model.safetensors", "--summary-json", "export.json")
    assert out.wait(120) == 0, out.output
    exported = read_json(tmp_path / "export.json")
    assert (exported["command"], exported["checkpoint"], exported["files"]) == (
        "export",
        s["checkpoint"],
        [str(tmp_path / "model.safetensors"), str(tmp_path / "model.config.json")],
    )
    # A fresh interpreter with neither torch nor Ray: safetensors and numpy only.
    code = (
        "import sys, json; from safetensors.numpy import load_file\n"
        "w = load_file('model.safetensors'); assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
        "print(json.dumps({k: list(v.shape) for k, v in w.items()}))"
    )
    import subprocess
    import sys

    shapes = json.loads(
        subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    )
    assert shapes == {
        "0.weight": [128, 64],
        "0.bias": [128],
        "2.weight": [128, 128],
        "2.bias": [128],
        "4.weight": [10, 128],
        "4.bias": [10],
    }
    config = json.loads((tmp_path / "model.config.json").read_text())
    assert config["step"] == s["steps"] and config["config"]["pipeline"] == "digits"
    # The exported weights are the trained ones: the same held-out accuracy.
    from safetensors.torch import load_file

    from raylane.config import load_config
    from raylane.pipelines.digits import build_model, load_split

    model = build_model(load_config("digits").model)
    model.load_state_dict(load_file(tmp_path / "model.safetensors"))
    x, y = load_split()[1].tensors
    accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(s["metrics"]["accuracy"], abs=1e-6)


def test_export_refuses_a_corrupt_checkpoint(run_cli, tmp_path):
    path = _save(tmp_path, 5, 1.0)
    (path / checkpoint.MANIFEST_FILE).write_text("{}")
    proc = run_cli("export", str(path), "--out", "x.safetensors")
    assert proc.wait(60) == 2
    assert "not a valid checkpoint" in proc.output and "Traceback" not in proc.output


def test_epoch_checkpoints_and_evaluations_follow_their_every_n_epochs(run_cli, tmp_path):
    # regression: 64 steps per epoch in one process.
    proc = run_cli(
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=e",
        "--set",
        "train.max_epochs=5",
        "--set",
        "checkpoint.every_n_epochs=2",
        "--set",
        "train.eval_every_n_epochs=0",
        "--summary-json",
        "s.json",
    )
    assert proc.wait(120) == 0, proc.output
    names = sorted(p.name for p in (tmp_path / "runs" / "e").glob("checkpoint_*"))
    assert names == [checkpoint.checkpoint_name(s) for s in (128, 256, 320)]  # epochs 2, 4 and the end
    evaluations = [line for line in proc.output.splitlines() if line.startswith("[raylane] ") and " eval: " in line]
    assert len(evaluations) == 1, evaluations  # only the end of the run
    assert read_json(tmp_path / "s.json")["metrics"]["loss"] > 0


def test_a_replicated_checkpoint_in_the_earlier_dcp_format_still_loads(tmp_path):
    """Before the one-file format, rank 0 wrote a replicated state with DCP: such checkpoints of
    runs started earlier must still resume."""
    model = torch.nn.Linear(4, 2)
    torch.nn.init.constant_(model.weight, 5.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / checkpoint.checkpoint_name(7)
    path.mkdir()
    checkpoint.state.dcp().save(checkpoint.live_state(model, optimizer), checkpoint_id=str(path), no_dist=True)
    (path / checkpoint.rng_file(0)).write_text(json.dumps(checkpoint.rng_state()))
    checkpoint.PendingSave(path, 0, {"step": 7}).commit()
    assert {".metadata", "__0_0.distcp"} <= set(checkpoint.read_manifest(path)["files"])

    fresh = torch.nn.Linear(4, 2)
    assert checkpoint.load(path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1)) == {"step": 7}
    assert torch.all(fresh.weight == 5.0)


RANKS_RNG = textwrap.dedent("""
    import json, os, random, sys
    import numpy as np, torch, torch.distributed as dist
    from raylane.loop import checkpoint
    from raylane.loop.checkpoint import agree

    rank, path, init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(100 + rank); np.random.seed(200 + rank); random.seed(300 + rank)
    checkpoint.save(path, model, optimizer, {"step": 3, "world_size": 2}, rank=rank)
    def draws():
        return [torch.rand(2).tolist(), np.random.rand(2).tolist(), [random.random() for _ in range(2)]]
    expected = draws()
    torch.manual_seed(0); np.random.seed(0); random.seed(0)
    checkpoint.load(path, model, optimizer, rank=rank)
    restored = draws()
    # the commit's gather hands rank 0 every part, small or large (the others none)
    gathered = [agree.gather({"rank": rank}), agree.gather("x" * (40_000 if rank else 10))]
    print(json.dumps({"expected": expected, "restored": restored, "gathered": gathered}), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # as `raylane` exits (cli.run): gloo's threads can abort the interpreter's teardown
""")


def test_each_ranks_random_generators_come_back_from_a_replicated_checkpoint(tmp_path):
    """A DDP checkpoint is rank 0's one file; every rank's torch, numpy and python generators
    travel to rank 0 in the commit, and each rank gets its own back on load. The commit's gather
    hands rank 0 every part, whatever its size, and the others none."""
    path = tmp_path / checkpoint.checkpoint_name(3)
    path.mkdir()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANKS_RNG, str(rank), str(path), init],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(checkpoint.read_manifest(path)["files"]) == ["state.pt"]
    for r in results:
        assert r["restored"] == r["expected"]
    assert results[0]["expected"] != results[1]["expected"]  # two ranks, two streams
    assert results[0]["gathered"] == [[{"rank": 0}, {"rank": 1}], ["x" * 10, "x" * 40_000]]
    assert results[1]["gathered"] == [[], []]


def _stepped(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(
        [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "lr": 0.1}]
    )
    model(torch.randn(8, 3)).sum().backward()
    optimizer.step()
    return optimizer


def test_a_replicated_states_references_match_dcps_or_come_from_dcp():
    """A save takes a replicated state's references without DCP's get_state_dict once the first
    save found both ways agree; a wrapper the name map does not know keeps DCP's way."""
    from raylane.loop.checkpoint.staging import LiveState, _same

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    optimizer, live = _stepped(model), LiveState()
    for _ in range(2):
        assert _same(live.take(model, optimizer, checkpoint.live_state), checkpoint.live_state(model, optimizer))
    assert live._names == ["0.weight", "0.bias", "2.weight", "2.bias"]  # the second came from the map
    taken = live.take(model, optimizer, checkpoint.live_state)
    optimizer.state[model[0].weight]["step"] = 99.0  # rebound by the loop after the save took its references
    assert taken["optim"]["state"]["0.weight"]["step"] is not optimizer.state[model[0].weight]["step"]

    optimizer.add_param_group({"params": list(model[1].parameters())})  # unfreezing: the map is built again
    assert _same(live.take(model, optimizer, checkpoint.live_state), checkpoint.live_state(model, optimizer))
    assert live._names == ["0.weight", "0.bias", "2.weight", "2.bias", "1.weight", "1.bias"]

    compiled = torch.compile(model)  # DCP names its parameters without `_orig_mod.`; the map would not
    wrapped = LiveState()
    for _ in range(2):
        assert _same(
            wrapped.take(compiled, optimizer, checkpoint.live_state), checkpoint.live_state(compiled, optimizer)
        )
    assert wrapped._names is None
