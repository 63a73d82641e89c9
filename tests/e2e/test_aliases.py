"""Models that hold a tensor under two names (tests/helpers/shared_weights.py: a wrapper that
exposes its inner model's layers as `model.blocks`, and a language model with tied input and
output embeddings) checkpoint each tensor once and resume bit-exact: in one process, under DDP
and FSDP on 2 ranks, across the two, and on Ray. Export writes them once too."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from raylane.loop import checkpoint
from tests.conftest import REPO, TORCHRUN, read_json, wait_for
from tests.helpers.shared_weights import MODELS, lm_loss, tokens

pytestmark = pytest.mark.untracked

HELPER = REPO / "tests" / "helpers" / "shared_weights.py"
CONFIG = """pipeline: ./pipe.py
train: {batch_size: 8, max_epochs: 3}
optim: {name: adamw, lr: 0.05}
checkpoint: {every_n_steps: 3}
"""


@pytest.fixture
def project(tmp_path) -> Path:
    """The user's own pipeline file and config, in the test's directory."""
    shutil.copy(HELPER, tmp_path / "pipe.py")
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    return tmp_path


def _trained(path: str, kind: str) -> dict[str, torch.Tensor]:
    """A checkpoint's weights and optimizer state, loaded in this one process."""
    torch.manual_seed(123)  # weights unlike the checkpoint's, so that a load that misses one shows
    model = MODELS[kind]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    checkpoint.load(path, model, optimizer)
    state = dict(model.state_dict())
    for i, (name, _) in enumerate(model.named_parameters()):
        for key, value in optimizer.state_dict()["state"].get(i, {}).items():
            state[f"optim {name} {key}"] = value
    return state


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def _train(run_cli, launch: str, kind: str, name: str, steps: int) -> dict:
    args = [
        "train",
        "cfg.yaml",
        "--set",
        f"model.kind={kind}",
        "--set",
        f"run.name={name}",
        "--set",
        f"train.max_steps={steps}",
        "--summary-json",
        f"{name}-{steps}.json",
    ]
    if launch == "local":
        proc = run_cli(*args, "--local", name=name)
    else:
        proc = run_cli(
            "--nproc_per_node",
            "2",
            "-m",
            "raylane",
            *args,
            "--set",
            f"strategy.name={launch}",
            launcher=TORCHRUN,
            name=name,
        )
    assert proc.wait(180) == 0, proc.output
    return read_json(Path(proc.log_path).parent / f"{name}-{steps}.json")


# In make test: the tied model in one process, and the issue's own failure (the aliased model
# under DDP); the rest (two torchrun ranks twice each: ~8 s apiece) in make test-all.
@pytest.mark.parametrize(
    "launch, kind",
    [
        ("local", "tied"),
        ("ddp", "aliased"),
        pytest.param("local", "aliased", marks=pytest.mark.slow),
        pytest.param("ddp", "tied", marks=pytest.mark.slow),
        pytest.param("fsdp", "aliased", marks=pytest.mark.slow),
        pytest.param("fsdp", "tied", marks=pytest.mark.slow),
    ],
)
def test_a_model_with_shared_tensors_resumes_bit_exact(run_cli, project, launch, kind):
    """Train 7 steps straight; a run that stopped after the straight run's checkpoint at step 6
    (mid-epoch, saved asynchronously) resumes from it to 7: the same weights and optimizer state,
    bit for bit. Before, the relaunch of the aliased model under DDP failed: 'Missing key(s)
    "module.blocks.0..." Unexpected key(s) "blocks.0..."'."""
    straight = _train(run_cli, launch, kind, "straight", 7)
    stopped = project / "runs" / "resumed" / checkpoint.checkpoint_name(6)
    shutil.copytree(Path(straight["checkpoint"]).parent / stopped.name, stopped)
    resumed = _train(run_cli, launch, kind, "resumed", 7)
    assert resumed["resumed_from_step"] == 6 and resumed["steps"] == 7
    _assert_same(_trained(resumed["checkpoint"], kind), _trained(straight["checkpoint"], kind))
    # Each tensor once, under its canonical name; the other names are listed.
    manifest = checkpoint.read_manifest(resumed["checkpoint"])
    if kind == "tied":
        assert manifest["aliases"] == {"out.weight": "emb.weight"}
    else:
        assert manifest["aliases"] == {
            f"blocks.{i}.{p}": f"inner.blocks.{i}.{p}" for i in (0, 1) for p in ("weight", "bias")
        }
    assert not set(manifest["aliases"]) & set(manifest["shapes"])


@pytest.mark.ray
@pytest.mark.shared_ray
@pytest.mark.slow  # the same load as the DDP case above, under Ray: ~30 s
def test_ctrl_c_and_a_relaunch_of_the_aliased_model_on_ray(run_cli, project):
    """The user's way on Ray: train on 2 DDP workers, Ctrl-C once a checkpoint exists, relaunch
    the same run.name; it resumes and finishes."""
    args = [
        "train",
        "cfg.yaml",
        "--set",
        "run.name=ray",
        "--set",
        "scaling.num_workers=2",
        "--set",
        f"run.storage_path={project / 'runs'}",
    ]
    first = run_cli(*args, "--set", "train.max_epochs=500", "--summary-json", "first.json", name="first")
    wait_for(lambda: checkpoint.committed(str(project / "runs" / "ray")), timeout_s=240, interval_s=0.5)
    first.signal(signal.SIGINT)
    assert first.wait(180) == 130, first.output
    stopped = read_json(project / "first.json")
    assert stopped["preempted"] and stopped["checkpoint"], stopped
    again = run_cli(
        *args, "--set", f"train.max_steps={stopped['steps'] + 2}", "--summary-json", "again.json", name="again"
    )
    assert again.wait(240) == 0, again.output
    s = read_json(project / "again.json")
    assert s["status"] == "FINISHED" and s["resumed_from_step"] == stopped["steps"], again.output
    _trained(s["checkpoint"], "aliased")  # loads, each tensor once


CROSS = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from raylane.loop import checkpoint
    from tests.helpers.shared_weights import MODELS, lm_loss, tokens

    rank, root, init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    x, y = tokens().tensors
    x, y = x[rank::2][:8], y[rank::2][:8]

    def make(kind, strategy, seed):
        torch.manual_seed(seed)
        model = MODELS[kind]()
        if strategy == "ddp":
            model = DistributedDataParallel(model)
        else:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=0.05)

    def step(model, optimizer):
        optimizer.zero_grad()
        lm_loss(model(x), y).backward()
        optimizer.step()

    def whole(model, optimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
        return {**model_sd, **{f"{k} {n}": v for k, s in optim_sd["state"].items() for n, v in s.items()}}

    differ = {}
    for kind in MODELS:
        for src in ("ddp", "fsdp"):
            for dst in ("ddp", "fsdp"):
                path = f"{root}/{kind}-{src}-{dst}"
                os.makedirs(path, exist_ok=True)
                a, opt_a = make(kind, src, 0)
                step(a, opt_a)
                step(a, opt_a)
                checkpoint.save(path, a, opt_a, {"step": 2, "world_size": 2}, rank=rank)
                b, opt_b = make(kind, dst, 1)
                checkpoint.load(path, b, opt_b, rank=rank)
                saved, loaded = whole(a, opt_a), whole(b, opt_b)
                differ[f"{kind} {src}->{dst}"] = sorted(set(saved) ^ set(loaded)) + sorted(
                    k for k in saved if k in loaded and not torch.equal(saved[k], loaded[k]))
                step(b, opt_b)  # and trains on
    print(json.dumps(differ), flush=True)
    dist.destroy_process_group()
    os._exit(0)  # as `raylane` exits (cli.run): gloo's threads can abort the interpreter's teardown
""")


@pytest.mark.slow  # ~20 s: 4 processes; make test loads checkpoints across DDP and FSDP (test_strategies.py) and trains and exports a tied model (test_hf_lora.py's full fine-tune)
def test_shared_tensors_load_across_ddp_and_fsdp(tmp_path):
    """A DDP checkpoint (rank 0's state.pt) loads into FSDP and an FSDP one (DCP shards) into DDP,
    and each into its own kind, for both models: weights and optimizer state exactly as saved."""
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CROSS, str(rank), str(tmp_path), init],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    differ = json.loads(outs[0][0].strip().splitlines()[-1])
    assert len(differ) == 8 and not any(differ.values()), differ
    for kind in MODELS:
        assert checkpoint.read_manifest(tmp_path / f"{kind}-fsdp-ddp")["aliases"]


def _old_format(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, sharded: bool) -> None:
    """A checkpoint as raylane wrote it before: every name of a shared tensor in the model state
    and in the manifest's shapes (in one state.pt, or in DCP's format)."""
    state = {
        "model": model.state_dict(),
        "optim": checkpoint.state.dcp().state_dict.get_state_dict(model, optimizer)[1],
    }
    path.mkdir()
    if sharded:
        checkpoint.state.dcp().save(state, checkpoint_id=str(path), no_dist=True)
    else:
        torch.save({**state, "rng": [json.dumps(checkpoint.rng_state())]}, path / checkpoint.STATE_FILE)
    manifest = {"train_state": {"step": 1}, "shapes": checkpoint.model_shapes(model.state_dict()), "files": {}}
    (path / checkpoint.MANIFEST_FILE).write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_checkpoints_of_earlier_versions_with_every_name_still_load(tmp_path, kind):
    torch.manual_seed(0)
    model = MODELS[kind]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    x, y = tokens().tensors
    lm_loss(model(x[:8]), y[:8]).backward()
    optimizer.step()
    for sharded in (False, True):
        path = tmp_path / f"old-{sharded}"
        _old_format(path, model, optimizer, sharded=sharded)
        torch.manual_seed(1)
        fresh = MODELS[kind]()
        checkpoint.load(path, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.05))
        _assert_same(fresh.state_dict(), model.state_dict())


def test_a_checkpoint_missing_a_tensor_that_is_no_alias_is_refused_naming_it(tmp_path):
    model = MODELS["tied"]()
    optimizer = torch.optim.AdamW(model.parameters())
    path = tmp_path / checkpoint.checkpoint_name(1)
    path.mkdir()
    checkpoint.save(path, model, optimizer, {"step": 1}, rank=0)
    state = torch.load(path / checkpoint.STATE_FILE, weights_only=True)
    del state["model"]["blocks.1.bias"]
    torch.save(state, path / checkpoint.STATE_FILE)
    manifest = checkpoint.read_manifest(path)
    del manifest["shapes"]  # as an earlier version wrote it: nothing to compare first
    (path / checkpoint.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointLoadError, match=r"blocks\.1\.bias is absent there"):
        checkpoint.load(path, model, optimizer)


def test_export_of_the_tied_model_writes_each_tensor_once_and_loads_back(run_cli, project):
    s = _train(run_cli, "local", "tied", "lm", 3)
    out = run_cli("export", s["checkpoint"], "--out", "lm.safetensors", "--summary-json", "export.json", name="export")
    assert out.wait(120) == 0, out.output
    exported = read_json(project / "export.json")
    assert (exported["command"], exported["checkpoint"], exported["files"]) == (
        "export",
        s["checkpoint"],
        [str(project / "lm.safetensors"), str(project / "lm.config.json")],
    )
    # A fresh interpreter with neither torch nor Ray: safetensors and numpy only.
    code = (
        "import sys, json; from safetensors.numpy import load_file\n"
        "w = load_file('lm.safetensors'); assert 'torch' not in sys.modules and 'ray' not in sys.modules\n"
        "print(json.dumps({k: list(v.shape) for k, v in w.items()}))"
    )
    shapes = json.loads(
        subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, check=True).stdout
    )
    from safetensors import safe_open
    from safetensors.torch import load_file

    weights = load_file(project / "lm.safetensors")
    assert sorted(weights) == ["blocks.0.bias", "blocks.0.weight", "blocks.1.bias", "blocks.1.weight", "emb.weight"]
    assert shapes == {k: list(v.shape) for k, v in weights.items()}
    with safe_open(project / "lm.safetensors", "pt") as f:
        assert json.loads(f.metadata()["aliases"]) == {"out.weight": "emb.weight"}
    config = read_json(project / "lm.config.json")
    assert config["aliases"] == {"out.weight": "emb.weight"} and config["step"] == s["steps"] == 3
    model = MODELS["tied"]()
    model.load_state_dict({**weights, "out.weight": weights["emb.weight"]})
    trained = _trained(s["checkpoint"], "tied")
    _assert_same(model.state_dict(), {k: v for k, v in trained.items() if not k.startswith("optim ")})

    from raylane.export import load_model

    loaded, example = load_model(s["checkpoint"])  # what the MLflow model is logged from
    assert loaded.out.weight is loaded.emb.weight and torch.equal(loaded.emb.weight, weights["emb.weight"])
    assert loaded(example).shape == (2, 8, 16)
