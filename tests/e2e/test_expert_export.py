"""LoRA and the export under expert parallelism (issue 65 §3): a tiny Qwen2-MoE (4 experts, top-2,
a shared expert) made here, trained by `raylane train` through the hf pipeline on 2 torchrun
ranks (gloo), one JSON Lines file a rank.

- LoRA on the attention (the default targets), the experts frozen: at `strategy.ep: 2` the losses
  are the run's at ep 1, and each rank still holds half the experts' bytes (the frozen experts
  are split like trained ones: tests/helpers/expert_bytes.py records what each rank holds).
- `raylane export --format hf` of an ep 2 checkpoint (its experts saved as DTensor shards, each
  rank its half, in its own file): the folder `from_pretrained` loads with every expert in place,
  and its logits equal the checkpoint's model as raylane loads it into one process. In full (the
  experts trained, equal to DCP's own read of the shards), and with LoRA merged (the experts the
  base's) and as an adapter alone (`PeftModel.from_pretrained`).
- LoRA naming the experts modules themselves is refused before anything starts (raylane.hf.lora)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch

from tests.conftest import REPO, TORCHRUN, ForkedProcess, cli_env, forked_argv, read_json, zygote

STEPS = 4
GAP = 1e-5  # fp32
CONFIG = (
    "model: {name_or_path: ./base, task: causal-lm, seq_len: 32}\n"
    "data: {format: json, train: ./rows}\n"
    "strategy: {name: ddp}\n"
    f"train: {{max_steps: {STEPS}, batch_size: 4, seed: 1}}\n"
    "optim: {name: adamw, lr: 0.01}\n"
    "checkpoint: {every_n_steps: 0}\n"
    "mlflow: {log_every_n_steps: 1, log_model: false, system_metrics: false}\n"
)
# tests/helpers/expert_bytes.py: the hf pipeline, and what each rank holds of the experts.
HELD = "pipeline: tests.helpers.expert_bytes\nheld: {out: ./held}\nlora: {r: 4, alpha: 8}\n" + CONFIG
PLAIN = "pipeline: hf\n" + CONFIG


def _project(root: Path) -> Path:
    """The base (tokenizer included) and 64 rows of text in two files, one a rank."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import hf_families, hf_tiny

    torch.manual_seed(0)
    config = hf_families.qwen2_moe(vocab_size=hf_tiny.VOCAB, bos_token_id=1, eos_token_id=1)
    hf_tiny.save(AutoModelForCausalLM.from_config(config), root / "base")
    lines = (hf_tiny.rows(root / "text", n=64) / "train.jsonl").read_text().splitlines()
    (root / "rows").mkdir()
    for i, part in enumerate(("a", "b")):
        (root / "rows" / f"{part}.jsonl").write_text("\n".join(lines[32 * i : 32 * (i + 1)]) + "\n")
    (root / "lora.yaml").write_text(HELD)
    (root / "full.yaml").write_text(PLAIN)
    return root


def _train(root: Path, config: str, name: str, *sets: str) -> ForkedProcess:
    """`raylane train` on 2 torchrun ranks, its MLflow database its own (runs/<name>/mlflow.db)."""
    where = root / "mlflow" / name
    where.mkdir(parents=True)
    args = ["--nproc_per_node", "2", "-m", "raylane", "train", config, "--set", f"run.name={name}"]
    args += [*(x for s in sets for x in ("--set", s)), "--summary-json", f"{name}.json"]
    env = cli_env(where, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env["RAYLANE_TESTS_ZYGOTE_SOCKET"] = zygote().socket
    return ForkedProcess(zygote(), forked_argv(TORCHRUN, tuple(args)), root, env, root / f"{name}.log")


def _side_by_side(root: Path, runs: dict[str, tuple[str, ...]]) -> None:
    started = {name: _train(root, how[0], name, *how[1:]) for name, how in runs.items()}
    try:
        codes = {name: p.wait(400) for name, p in started.items()}
    finally:
        for p in started.values():
            p.kill_group()  # a run still going after a failure, by its own ids
    for name, code in codes.items():
        assert code == 0, started[name].output
        assert read_json(root / f"{name}.json")["status"] == "FINISHED"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """LoRA at ep 1 and ep 2, and a full fine-tune at ep 2, all DDP on 2 ranks, side by side."""
    root = _project(tmp_path_factory.mktemp("expert-export"))
    _side_by_side(
        root,
        {
            "lora-ep1": ("lora.yaml", "held.out=./held/ep1"),
            "lora-ep2": ("lora.yaml", "held.out=./held/ep2", "strategy.ep=2"),
            "full-ep2": ("full.yaml", "strategy.ep=2", "mlflow.enabled=false"),  # no loss read
        },
    )
    return root


def _losses(root: Path, name: str) -> list[float]:
    run_id = read_json(root / f"{name}.json")["run_id"]
    with sqlite3.connect(root / "mlflow" / name / "mlflow.db") as con:
        rows = con.execute("SELECT step, value FROM metrics WHERE run_uuid = ? AND key = 'train/loss'", (run_id,))
        return [value for _, value in sorted(rows)]


def _held(root: Path, ep: str) -> list[dict]:
    return [json.loads((root / "held" / ep / f"held-{rank}.json").read_text()) for rank in (0, 1)]


def _checkpoint(root: Path, name: str) -> str:
    return read_json(root / f"{name}.json")["checkpoint"]


def _export(run_cli, root: Path, checkpoint: str, out: str, *extra: str) -> Path:
    env = cli_env(root, PYTHONPATH=str(REPO))  # the pipeline tests.helpers.expert_bytes
    p = run_cli("export", checkpoint, "--format", "hf", "--out", str(root / out), *extra, cwd=root, env=env)
    assert p.wait(120) == 0, p.output
    return root / out


def _ids() -> torch.Tensor:
    from tests.helpers import hf_tiny

    return torch.randint(3, hf_tiny.VOCAB, (3, 16), generator=torch.Generator().manual_seed(5))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _trained_logits(checkpoint: str) -> tuple[torch.Tensor, object]:
    """The checkpoint's model as raylane loads it into one process (`raylane export`'s build), and
    its logits."""
    from raylane.export import load_model

    model, _ = load_model(checkpoint)
    return _logits(model, _ids()), model


def _from_pretrained(folder: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    return model


def _experts(model) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if ".mlp.experts." in n}


# Slow (the module fixture's 3 torchruns, ~30 s): make test moves an FSDP×ep2 checkpoint into one
# process exactly (tests/e2e/test_expert_layouts.py), which the export builds on, and refuses LoRA on
# the experts below.
@pytest.mark.slow
def test_lora_on_the_attention_at_ep2_trains_as_at_ep1_with_its_frozen_experts_split(project):
    """Rank 0's loss at every step within 1e-5 of the ep 1 run's (measured: identical). Each
    rank holds half the experts' bytes at ep 2 and all of them at ep 1; the experts are frozen
    and only the adapter trains (peft's `base_model.model.` names)."""
    one, two = _losses(project, "lora-ep1"), _losses(project, "lora-ep2")
    assert len(one) == len(two) == STEPS
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) <= GAP, (one, two)
    assert read_json(project / "lora-ep2.json")["strategy"] == "ddp×ep2"
    for rank, (at1, at2) in enumerate(zip(_held(project, "ep1"), _held(project, "ep2"), strict=True)):
        assert at1["whole"] == at2["whole"] > 0 and at1["held"] == at1["whole"], (rank, at1)
        assert at2["held"] * 2 == at2["whole"], (rank, at2)
        for at in (at1, at2):
            assert not at["experts_train"] and at["trains"], at
            assert all(".lora_A." in n or ".lora_B." in n for n in at["trains"]), at["trains"]
            assert {n.split(".")[-4] for n in at["trains"]} == {"q_proj", "k_proj", "v_proj", "o_proj"}


# Slow (the module fixture's 3 torchruns, ~30 s): make test moves an FSDP×ep2 checkpoint into one
# process exactly (tests/e2e/test_expert_layouts.py), which the export builds on, and refuses LoRA on
# the experts below.
@pytest.mark.slow
def test_the_export_of_a_full_fine_tune_at_ep2_holds_every_expert_and_its_logits(run_cli, project):
    """The checkpoint holds each expert tensor as two halves, one in each rank's file; the export
    loads in from_pretrained with every expert, each the whole tensor DCP's own read gives (and
    trained: not the base's); its logits equal the checkpoint's model's (measured: identical)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint = _checkpoint(project, "full-ep2")
    meta = dcp.FileSystemReader(checkpoint).read_metadata()
    saved = [k for k in meta.state_dict_metadata if k.startswith("model.") and ".mlp.experts." in k]
    assert len(saved) == 4, saved  # gate_up_proj and down_proj of 2 layers
    for key in saved:
        chunks = meta.state_dict_metadata[key].chunks
        assert [(c.offsets[0], c.sizes[0]) for c in chunks] == [(0, 2), (2, 2)], (key, chunks)
        files = {info.relative_path for idx, info in meta.storage_data.items() if idx.fqn == key}
        assert files == {"__0_0.distcp", "__1_0.distcp"}, (key, files)

    trained, _ = _trained_logits(checkpoint)
    exported = _from_pretrained(_export(run_cli, project, checkpoint, "full-hf"))
    assert (trained - _logits(exported, _ids())).abs().max().item() <= GAP

    dcp_to_torch_save(checkpoint, project / "full-ep2.pt")
    whole = torch.load(project / "full-ep2.pt", weights_only=True)["model"]
    experts, base = _experts(exported), _experts(_from_pretrained(project / "base"))
    assert sorted(experts) == sorted(k.removeprefix("model.") for k in saved)
    for name, tensor in experts.items():
        assert tensor.shape[0] == 4 and torch.equal(tensor, whole[name]), name
        assert not torch.equal(tensor, base[name]), name


# Slow (the module fixture's 3 torchruns, ~30 s): make test moves an FSDP×ep2 checkpoint into one
# process exactly (tests/e2e/test_expert_layouts.py), which the export builds on, and refuses LoRA on
# the experts below.
@pytest.mark.slow
def test_a_lora_run_at_ep2_exports_merged_and_as_its_adapter(run_cli, project):
    """Merged: from_pretrained loads every expert, each the base's (frozen), and its logits are
    the trained adapter's (measured: within 1.2e-7). The adapter alone, on the base, the same."""
    from peft import PeftModel

    checkpoint = _checkpoint(project, "lora-ep2")
    trained, model = _trained_logits(checkpoint)
    base = _from_pretrained(project / "base")
    assert (trained - _logits(base, _ids())).abs().max().item() > 1e-3  # the adapter trained
    merged = _from_pretrained(_export(run_cli, project, checkpoint, "merged-hf"))
    assert (trained - _logits(merged, _ids())).abs().max().item() <= GAP
    frozen = _experts(base)
    assert all(torch.equal(t, frozen[n]) for n, t in _experts(merged).items()) and len(frozen) == 4

    adapter = _export(run_cli, project, checkpoint, "adapter-hf", "--adapter-only")
    peft_model = PeftModel.from_pretrained(_from_pretrained(project / "base"), adapter)
    assert (trained - _logits(peft_model, _ids())).abs().max().item() <= GAP


@pytest.mark.slow  # 2 more torchruns; make test exports DDP×ep2 above, and FSDP×ep2 checkpoints
# are read whole in one process by tests/e2e/test_expert_layouts.py
def test_fsdp_at_ep2_with_and_without_lora_exports_what_it_trained(run_cli, tmp_path):
    """FSDP×ep2 (each experts module an FSDP2 unit of its own over dp_rest): the same exports."""
    root = _project(tmp_path / "fsdp")
    _side_by_side(
        root,
        {
            "lora-fsdp": ("lora.yaml", "held.out=./held/fsdp", "strategy.ep=2", "strategy.name=fsdp"),
            "full-fsdp": ("full.yaml", "strategy.ep=2", "strategy.name=fsdp"),
        },
    )
    assert all(h["held"] * 2 == h["whole"] and not h["experts_train"] for h in _held(root, "fsdp"))
    for name, out in (("full-fsdp", "full-hf"), ("lora-fsdp", "merged-hf")):
        trained, _ = _trained_logits(_checkpoint(root, name))
        exported = _from_pretrained(_export(run_cli, root, _checkpoint(root, name), out))
        assert (trained - _logits(exported, _ids())).abs().max().item() <= GAP, name


def test_lora_naming_the_experts_modules_is_refused_before_anything_starts(tmp_path, capsys, no_work):
    """peft adapts the fused experts' 3-D parameters only through target_parameters, which the
    lora section does not take: `raylane train` exits 2 with one line naming the key before
    anything starts (before, at ep 1, the run failed in peft's get_peft_model once started)."""
    from raylane import cli

    root = _project(tmp_path / "refused")
    sets = ["strategy.ep=2", "scaling.num_workers=2", "held.out=./held", "lora.target_modules=[mlp.experts]"]

    def train() -> tuple[int, str]:
        capsys.readouterr()
        code = cli.main(["train", str(root / "lora.yaml"), *(x for s in sets for x in ("--set", s))])
        return code, capsys.readouterr().err.strip()

    code, err = train()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(
        "raylane: invalid config: lora.target_modules = ['mlp.experts']: 'mlp.experts' names the experts module "
        "model.layers.0.mlp.experts (Qwen2MoeExperts)"
    ), err
    assert "target_parameters" in err, err
    # The shared expert (dense: whole on every rank) and the attention are adapted at ep 2: the
    # checks pass, and the launch is reached (no_work stops it there).
    sets[-1] = "lora.target_modules=[q_proj,shared_expert.gate_proj]"
    with pytest.raises(AssertionError, match="something was started"):
        train()
