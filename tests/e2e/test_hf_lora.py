"""A Hugging Face causal LM (a tiny LLaMA made and saved here) fine-tuned with LoRA through peft
(raylane.hf.lora) and in full, from a pipeline of the test's own (tests/helpers/hf_lm.py: dict
batches with labels, the model's own loss): a LoRA checkpoint holds the adapter, its optimizer
state and the loop's state but no base weight; it resumes bit-exact after a stop and relaunch
(one process here, FSDP on 2 torchrun ranks in make test-all); a relaunch on another base
exits 2 naming both; `raylane export --format hf` writes what `from_pretrained` and
`PeftModel.from_pretrained` load."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch

from raylane.loop import checkpoint
from tests.conftest import REPO, TORCHRUN, cli_env, read_json
from tests.helpers.hf_lm import checkpoint_tensors

pytestmark = pytest.mark.untracked

HELPER = REPO / "tests" / "helpers" / "hf_lm.py"
CONFIG = """pipeline: ./pipe.py
model: {name_or_path: ./base}
train: {batch_size: 8, max_epochs: 2}
optim: {name: adamw, lr: 0.01}
checkpoint: {every_n_steps: 2}
mlflow: {enabled: false}
"""
LORA = "lora: {r: 4, alpha: 8}\n"


def _make_base(folder: Path, seed: int, tied: bool = False) -> None:
    sys.path.insert(0, str(HELPER.parent))
    try:
        import hf_lm
    finally:
        sys.path.remove(str(HELPER.parent))
    hf_lm.make_base(folder, seed, tied=tied)


def _train(
    project: Path, name: str, steps: int, *extra: str, launcher: list[str] | None = None, config: str = "lora.yaml"
) -> subprocess.CompletedProcess:
    args = [
        "train",
        config,
        "--set",
        f"run.name={name}",
        "--set",
        f"train.max_steps={steps}",
        "--summary-json",
        f"{name}-{steps}.json",
        *extra,
    ]
    argv = [*launcher, "-m", "raylane", *args] if launcher else [sys.executable, "-m", "raylane", *args, "--local"]
    # A process of its own, killed by subprocess.run when it overstays (its id, nothing broader).
    return subprocess.run(
        argv, check=False, cwd=project, env=cli_env(project), capture_output=True, text=True, timeout=240
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A base model, the pipeline, and a LoRA run of 4 steps (checkpoints at 2 and 4) and a full
    fine-tune of 2 of a base with tied embeddings, trained once for the module's tests."""
    root = tmp_path_factory.mktemp("hf")
    _make_base(root / "base", seed=0)
    _make_base(root / "tied", seed=2, tied=True)
    shutil.copy(HELPER, root / "pipe.py")
    (root / "full.yaml").write_text(CONFIG.replace("./base", "./tied"))
    (root / "lora.yaml").write_text(CONFIG + LORA)
    # The two at once: each is mostly one core's start-up (imports).
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(_train, root, name, steps, config=config)
            for name, steps, config in (("lora", 4, "lora.yaml"), ("full", 2, "full.yaml"))
        ]
        for run in runs:
            assert run.result().returncode == 0, run.result().stdout + run.result().stderr
    return root


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def _adapter_numel(project: Path) -> int:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(project / "base"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_only(project):
    ck = read_json(project / "lora-4.json")["checkpoint"]
    state = checkpoint_tensors(ck)
    weights = [k.removeprefix("model.") for k in state if k.startswith("model.")]
    # The adapter on every attention projection (the default target_modules), nothing of the base.
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), weights
    assert {k.split(".")[-4] for k in weights} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    # The optimizer holds the adapter alone: no frozen weight has hyperparameters (the flat form,
    # optim.param_groups.<name>.lr).
    grouped = {
        k.removeprefix("optim.param_groups.").rpartition(".")[0] for k in state if k.startswith("optim.param_groups.")
    }
    assert sorted(grouped) == sorted(weights)
    tensor_bytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    adapter = _adapter_numel(project) * 4  # float32
    # The adapter, AdamW's two moments of it, and a step count per tensor.
    assert 3 * adapter <= tensor_bytes <= 3 * adapter + 8 * len(weights)
    base_bytes = sum(f.stat().st_size for f in (project / "base").glob("*.safetensors"))
    assert tensor_bytes < base_bytes / 3
    manifest = checkpoint.read_manifest(ck)
    assert manifest["base"]["path"] == str(project / "base") and manifest["base"]["key"] == "model.name_or_path"
    assert len(manifest["base"]["fingerprint"]) == 64
    # The full fine-tune's checkpoint is the whole model, with no base recorded.
    full = checkpoint.read_manifest(read_json(project / "full-2.json")["checkpoint"])
    assert "base" not in full and "model.embed_tokens.weight" in full["shapes"]
    assert full["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}


def test_a_lora_run_resumes_bit_exact_and_not_on_another_base(project):
    """A run stopped after the straight run's checkpoint at step 2 resumes to 4 with the same
    adapter and optimizer state, bit for bit. Relaunched with another base (another seed, the
    same shapes), it exits 2 before anything starts, naming both bases; the same base in another
    folder resumes, and that folder's files replaced by another base's exit 2 (the path alone
    would not tell)."""
    straight = read_json(project / "lora-4.json")
    shutil.copytree(
        Path(straight["checkpoint"]).parent / checkpoint.checkpoint_name(2),
        project / "runs" / "resumed" / checkpoint.checkpoint_name(2),
    )
    proc = _train(project, "resumed", 4)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = read_json(project / "resumed-4.json")
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 4
    _assert_same(checkpoint_tensors(resumed["checkpoint"]), checkpoint_tensors(straight["checkpoint"]))

    _make_base(project / "other", seed=1)
    proc = _train(project, "resumed", 6, "--set", "model.name_or_path=./other")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert f"model.name_or_path = '{project / 'other'}'" in line, line
    assert f"trained on base '{project / 'base'}'" in line and "fingerprint" in line, line
    assert "Traceback" not in proc.stderr

    # The same check in this process (what a launch runs before anything starts): the base
    # copied to another folder passes; that folder's files replaced by another base's do not.
    from raylane import api, prechecks
    from raylane.config import ConfigError
    from raylane.runrecord import run_folder

    shutil.copytree(project / "base", project / "moved")
    sets = [f"run.storage_path={project / 'runs'}", "run.name=resumed", f"model.name_or_path={project / 'moved'}"]
    cfg = api.check(str(project / "lora.yaml"), sets)
    prechecks.check_resume(cfg, run_folder(cfg))
    shutil.rmtree(project / "moved")
    shutil.copytree(project / "other", project / "moved")
    with pytest.raises(ConfigError, match="this base is") as refused:
        cfg = api.check(str(project / "lora.yaml"), sets)
        prechecks.check_resume(cfg, run_folder(cfg))
    assert str(refused.value).count(repr(str(project / "moved"))) == 2  # the key's value, and this base


def test_a_checkpoint_loads_only_into_a_model_on_its_base(project):
    """The worker's own check (a pipeline with no config key for its base): a model marked with
    another base's fingerprint, or with none, is refused naming both."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from raylane.loop.checkpoint.frozen import set_base

    ck = read_json(project / "lora-4.json")["checkpoint"]
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(project / "base"),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    with pytest.raises(checkpoint.CheckpointLoadError, match="holds an adapter only, and this run's model is whole"):
        checkpoint.load(ck, model, optimizer)
    set_base(model, {"path": "elsewhere", "fingerprint": "ab" * 32})
    with pytest.raises(
        checkpoint.CheckpointLoadError,
        match=rf"trained on base '{project / 'base'}' \(fingerprint \w{{12}}\); this run's base is "
        r"'elsewhere' \(fingerprint abababababab\)",
    ):
        checkpoint.load(ck, model, optimizer)
    set_base(model, checkpoint.read_manifest(ck)["base"])
    assert checkpoint.load(ck, model, optimizer)["step"] == 4


def test_the_fingerprint_tells_a_retrained_base_of_the_same_shape(tmp_path):
    from raylane.loop.checkpoint.frozen import fingerprint

    _make_base(tmp_path / "a", seed=0)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    _make_base(tmp_path / "b", seed=1)
    assert fingerprint(tmp_path / "a") == fingerprint(tmp_path / "copy") != fingerprint(tmp_path / "b")
    assert fingerprint(tmp_path / "missing") is None and fingerprint("org/model-id") is None


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_hf_of_a_full_and_a_lora_run_loads_and_generates(project):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raylane import api
    from raylane.export import consolidated

    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    full_ck = read_json(project / "full-2.json")["checkpoint"]
    run_folder = str(Path(full_ck).parent)  # a run's folder: its newest checkpoint, said in one line
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "raylane",
            "export",
            run_folder,
            "--format",
            "hf",
            "--out",
            "full-hf",
            "--summary-json",
            "export.json",
        ],
        check=False,
        cwd=project,
        env=cli_env(project),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wrote a save_pretrained model to full-hf" in proc.stdout
    exported = read_json(project / "export.json")
    assert exported["checkpoint"] == full_ck and exported["format"] == "hf"
    assert str(project / "full-hf" / "config.json") in exported["files"]
    assert proc.stderr.strip() == f"raylane: exporting {full_ck}, the run's newest checkpoint", proc.stderr
    full = AutoModelForCausalLM.from_pretrained(project / "full-hf")
    assert full.lm_head.weight is full.model.embed_tokens.weight  # still tied
    trained, _, _ = consolidated(full_ck)
    assert torch.equal(_logits(full, ids), _logits(trained.model, ids))
    assert full.generate(ids[:1], max_new_tokens=4, do_sample=False).shape == (1, 12)
    assert AutoTokenizer.from_pretrained(project / "full-hf").convert_tokens_to_ids("w5") == 5

    lora_ck = read_json(project / "lora-4.json")["checkpoint"]
    api.export(lora_ck, str(project / "merged"), format="hf")
    api.export(lora_ck, str(project / "adapter"), format="hf", adapter_only=True)
    assert not list((project / "merged").glob("adapter*")) and (project / "adapter" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(project / "merged")
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(project / "base"), project / "adapter")
    base = AutoModelForCausalLM.from_pretrained(project / "base")
    trained, _, _ = consolidated(lora_ck)
    expected = _logits(trained.model, ids)
    assert not torch.allclose(_logits(base, ids), expected)  # the adapter trained
    assert torch.allclose(_logits(merged, ids), expected, atol=1e-5)
    assert torch.equal(_logits(adapter, ids), expected)
    assert merged.generate(ids[:1], max_new_tokens=4, do_sample=False).shape == (1, 12)


def test_export_hf_refuses_what_it_cannot_write(project, tmp_path):
    from raylane import api
    from raylane.config import ConfigError

    full_ck = read_json(project / "full-2.json")["checkpoint"]
    with pytest.raises(ConfigError, match=r"--adapter-only: checkpoint .* holds a whole model"):
        api.export(full_ck, str(tmp_path / "a"), format="hf", adapter_only=True)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(ConfigError, match=r"--out = .*taken.*: is not empty"):
        api.export(full_ck, str(tmp_path / "taken"), format="hf")
    with pytest.raises(ConfigError, match=r"--adapter-only: only with --format hf"):
        api.export(full_ck, str(tmp_path / "m.safetensors"), adapter_only=True)
    lora_ck = read_json(project / "lora-4.json")["checkpoint"]
    with pytest.raises(ConfigError, match=r"holds a LoRA adapter on the base .*; export it with --format hf"):
        api.export(lora_ck, str(tmp_path / "m.safetensors"))
    (tmp_path / "run" / "checkpoint_000000002").mkdir(parents=True)  # never committed
    with pytest.raises(ConfigError, match=r"a run folder with no valid checkpoint"):
        api.export(str(tmp_path / "run"), str(tmp_path / "n"), format="hf")


@pytest.mark.slow  # two launches of 2 torchrun ranks: ~50 s on 2 cores
def test_a_lora_run_under_fsdp_resumes_bit_exact(project):
    """The frozen base is sharded with the adapter in each FSDP2 unit (mixed requires_grad);
    the checkpoint (DCP, a shard per rank) holds the adapter alone and resumes bit for bit."""
    fsdp = ["--set", "strategy.name=fsdp"]
    launcher = [*TORCHRUN, "--nproc_per_node", "2"]
    proc = _train(project, "fsdp", 4, *fsdp, launcher=launcher)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    straight = read_json(project / "fsdp-4.json")
    assert list(Path(straight["checkpoint"]).glob("*.distcp"))  # sharded, not one state.pt
    shutil.copytree(
        Path(straight["checkpoint"]).parent / checkpoint.checkpoint_name(2),
        project / "runs" / "fsdp-resumed" / checkpoint.checkpoint_name(2),
    )
    proc = _train(project, "fsdp-resumed", 4, *fsdp, launcher=launcher)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = read_json(project / "fsdp-resumed-4.json")
    assert resumed["resumed_from_step"] == 2
    state = checkpoint_tensors(resumed["checkpoint"])
    _assert_same(state, checkpoint_tensors(straight["checkpoint"]))
    assert all(".lora_" in k for k in state if k.startswith("model."))
    # The sharded adapter checkpoint exports (read in one process) merged, as the replicated one does.
    from transformers import AutoModelForCausalLM

    from raylane import api

    api.export(resumed["checkpoint"], str(project / "fsdp-merged"), format="hf")
    merged = AutoModelForCausalLM.from_pretrained(project / "fsdp-merged")
    base = AutoModelForCausalLM.from_pretrained(project / "base")
    assert not torch.equal(merged.model.layers[0].self_attn.q_proj.weight, base.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(merged.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)


def test_the_mlflow_model_of_a_lora_run_is_the_merged_transformers_model_and_generates(project, tmp_path, monkeypatch):
    """What the driver logs at the end of an hf run (raylane.tracking.records.log_model): the
    transformers flavour with the run's tokenizer, which predicts text through pyfunc."""
    import mlflow
    import mlflow.pyfunc
    import mlflow.tracking._tracking_service.utils as tracking

    # log_model sets the process's tracking URI (as the driver's end of run does): not beyond this test.
    monkeypatch.setattr(tracking, "_tracking_uri", tracking._tracking_uri)

    from raylane.tracking.records import log_model
    from raylane.tracking.runs import RunHandle

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("hf"))
    handle = RunHandle(run.info.run_id, run.info.experiment_id, uri, resumed=False)
    logged = log_model(handle, read_json(project / "lora-4.json")["checkpoint"], None)
    model = mlflow.pyfunc.load_model(logged["model_uri"])
    assert model.metadata.flavors["transformers"]["task"] == "text-generation"
    out = model.predict(["w5 w6 w7"])
    assert isinstance(out[0], str) and out[0].startswith("w5 w6 w7") and len(out[0].split()) > 3


def test_lora_targets_the_attention_projections_by_default_and_names_a_wrong_module(project):
    from raylane.config import ConfigError
    from raylane.hf.lora import LoraSection, check_lora

    base = str(project / "base")
    assert sorted(check_lora(base, LoraSection())) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert check_lora(base, LoraSection(target_modules=["gate_proj"])) == ["gate_proj"]
    with pytest.raises(
        ConfigError,
        match=r"^lora.target_modules = \['q_proj', 'nope'\]: LlamaForCausalLM has no "
        r"module named 'nope' \(its attention projections: k_proj, o_proj, q_proj, "
        r"v_proj\)$",
    ):
        check_lora(base, LoraSection(target_modules=["q_proj", "nope"]))


def test_an_adapter_made_on_the_meta_device_is_initialized_as_peft_does(tmp_path):
    """What a pipeline that builds on the meta device and loads the base from rank 0 does
    (issue 38's loading): apply_lora on meta, to_empty, then init_adapter gives every rank the
    same adapter from the same seed, lora_B zeros (the model starts as its base)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from raylane.hf.lora import LoraSection, apply_lora, init_adapter

    _make_base(tmp_path / "base", seed=0)

    def made(seed: int) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "base"))
        model = apply_lora(model, LoraSection(r=4), base=str(tmp_path / "base"))
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        assert init_adapter(model) == 8  # 4 projections x 2 layers
        return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}

    first, again = made(0), made(0)
    assert sorted(first) == sorted(again) and all(torch.equal(first[k], again[k]) for k in first)
    assert all(not v.any() for k, v in first.items() if ".lora_B." in k)
    assert all(v.abs().sum() > 0 for k, v in first.items() if ".lora_A." in k)
