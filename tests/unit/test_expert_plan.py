"""Expert parallelism's refusals before anything starts (issue 65), each one line naming the key
and its value, exit 2, through the real config loading and `raylane.api.prepare_train` (every
door's preparation: on Ray, under torchrun, --local) or the CLI: `strategy.ep` beside what it does
not combine with yet, on a world whose data-parallel ranks it does not divide, on a pipeline that
gives no ep_plan or one naming nothing (found on the model built on the meta device), and for
the hf pipeline from config.json alone: a dense model, a number of experts ep does not divide.
And `resolve_ep_plan` on tiny models: a user's own torchtitan-style MoE (tests/helpers/moe_own.py)
and transformers' own Qwen2-MoE and Mixtral, with and without a LoRA adapter."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from raylane import api, cli, layout_checks
from raylane.config import load_config
from raylane.errors import ConfigError
from raylane.loop.distributed.expert_plan import resolve_ep_plan
from tests.conftest import REPO
from tests.helpers import moe_own

HELPER = REPO / "tests" / "helpers" / "moe_own.py"


@pytest.fixture
def config(tmp_path) -> Path:
    """A user's own MoE pipeline's config: 2 Ray workers, nothing recorded."""
    shutil.copy(HELPER, tmp_path / "moe_own.py")
    (tmp_path / "train.yaml").write_text(
        f"pipeline: ./moe_own.py\nscaling:\n  num_workers: 2\nmlflow:\n  enabled: false\n"
        f"run:\n  storage_path: {tmp_path / 'runs'}\n"
    )
    return tmp_path / "train.yaml"


def _refused(config: Path, *sets: str, **kwargs) -> str:
    with pytest.raises(ConfigError) as raised:
        api.prepare_train(str(config), list(sets), **kwargs)
    line = str(raised.value)
    assert len(line.splitlines()) == 1, line
    return line


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            ["strategy.tp=2"],
            "strategy.tp = 2 with strategy.ep = 2: expert parallelism beside tensor parallelism is not supported "
            "yet; use strategy.tp: 1 (the dense layers sharded by FSDP), or strategy.ep: 1",
        ),
        (["strategy.tp=auto"], "strategy.tp = 'auto' with strategy.ep = 2: expert parallelism beside tensor"),
        (
            ["strategy.pp=2", "strategy.name=fsdp"],
            "strategy.pp = 2 with strategy.ep = 2: expert parallelism inside pipeline stages is not supported yet; "
            "use strategy.pp: 1 (the dense layers sharded by FSDP), or strategy.ep: 1",
        ),
        (
            ["strategy.name=auto"],
            "strategy.name = 'auto' with strategy.ep = 2: the memory estimate counts every expert on every rank; "
            "name ddp or fsdp",
        ),
        (
            ["strategy.name=fsdp", "strategy.dp_replicate=2", "scaling.num_workers=4"],
            "strategy.dp_replicate = 2 with strategy.ep = 2: expert parallelism with HSDP's replicas is not "
            "supported yet; use strategy.dp_replicate: 1",
        ),
        (
            ["fault_tolerance.enabled=true", "fault_tolerance.replica_groups=2", "scaling.num_workers=4"],
            "fault_tolerance.enabled with strategy.ep = 2: expert parallelism inside replica groups is not "
            "supported yet; use strategy.ep: 1, or no fault_tolerance",
        ),
        (
            ["scaling.min_workers=2", "scaling.num_workers=4"],
            "scaling.num_workers = [2, 4] with strategy.ep = 2: elastic runs keep no expert-parallel layout yet; "
            "give one number of workers",
        ),
    ],
)
def test_what_ep_does_not_combine_with_yet_is_refused_by_its_key(config, sets, line):
    """Each combination not built yet is one line naming both keys and saying what to do, from the
    config's own validation (tp, pp, auto, HSDP) or the layout check (replica groups, elastic)."""
    assert line in _refused(config, "strategy.ep=2", *sets)


def test_ep_must_divide_the_data_parallel_ranks_of_the_world_the_run_will_have(config, monkeypatch):
    """The world is the one each door will have, named as the user set it: Ray's workers, torchrun's
    WORLD_SIZE, --local's one process. A degree that divides it passes."""
    tail = "(each group of ep of them holds one copy of the experts, split)"
    line = _refused(config, "strategy.ep=3", "scaling.num_workers=4")
    assert line == f"strategy.ep = 3: does not divide the 4 data-parallel ranks of scaling.num_workers = 4 {tail}"
    line = _refused(config, "strategy.ep=2", local=True)
    assert line == f"strategy.ep = 2: does not divide the 1 data-parallel rank of the one process of --local {tail}"
    api.prepare_train(str(config), ["strategy.ep=4", "scaling.num_workers=8"])
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    line = _refused(config, "strategy.ep=4")
    assert line == f"strategy.ep = 4: does not divide the 6 data-parallel ranks of torchrun's WORLD_SIZE = 6 {tail}"
    api.prepare_train(str(config), ["strategy.ep=3", "model.experts=6"])  # 6 under torchrun, whatever num_workers says


def test_a_pipeline_without_an_ep_plan_is_refused_declared_or_found_on_the_model(config):
    """A config that declares no ep_plan (gives_ep_plan False) is refused at once; one that declares
    nothing is refused with the same line once its model is built on the meta device."""
    line = (
        "strategy.ep = 2: the moe_own pipeline gives no ep_plan (which modules are its experts): give its Pipeline "
        "an ep_plan (docs/strategies.md, Expert parallelism), or use strategy.ep: 1"
    )
    assert _refused(config, "strategy.ep=2", "model.declares=false") == line
    assert _refused(config, "strategy.ep=2", "model.plan=none") == line
    assert api.prepare_train(str(config), ["strategy.ep=2", "model.declares=true"]).cfg.strategy.ep == 2


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            ["model.plan=no_module"],
            "strategy.ep = 2: Pipeline.ep_plan: 'layers.*.moe.expert' names no module of TinyMoE",
        ),
        (
            ["model.experts=3"],
            "strategy.ep = 2: Pipeline.ep_plan: layers.0.moe.experts has 3 experts, which 2 ranks cannot hold in "
            "equal shares (each of the ep ranks holds experts / ep)",
        ),
        (["model.plan=router"], "strategy.ep = 2: Pipeline.ep_plan: layers.0.moe.router (Linear) is not an experts"),
        (
            ["model.plan=block"],
            "strategy.ep = 2: Pipeline.ep_plan: layers.0.moe (MoE) holds layers.0.moe.router.weight",
        ),
    ],
)
def test_a_plan_that_names_no_experts_module_is_refused_before_start(config, sets, line):
    """What only the model can tell, told before start from its meta build: a pattern naming
    nothing, experts that ep does not divide, a module that is not an experts module."""
    assert _refused(config, "strategy.ep=2", *sets).startswith(line)


def test_train_on_ray_says_the_line_and_exits_2_before_anything_starts(config, capsys, no_work):
    """The CLI door: `raylane train CONFIG --set strategy.ep=3` on 2 workers exits 2 with the one
    line, nothing started (no_work); `raylane check` says the same."""
    capsys.readouterr()
    assert cli.main(["train", str(config), "--set", "strategy.ep=3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (
        "raylane: strategy.ep = 3: does not divide the 2 data-parallel ranks of scaling.num_workers = 2 (each "
        "group of ep of them holds one copy of the experts, split)"
    ), err
    assert cli.main(["check", str(config), "--set", "strategy.ep=3"]) == 2
    assert capsys.readouterr().err == err


def test_resolve_ep_plan_on_a_torchtitan_style_model():
    """Paths in the model's order, from a list, one string or a function; each refusal names the
    pattern or the module."""
    model = moe_own.TinyMoE(moe_own.Model(layers=3))
    paths = ["layers.0.moe.experts", "layers.1.moe.experts", "layers.2.moe.experts"]
    assert resolve_ep_plan(model, ["layers.*.moe.experts"], ep=4) == paths
    assert resolve_ep_plan(model, "layers.*.moe.experts") == paths
    assert resolve_ep_plan(model, ["layers.2.moe.experts", "layers.0.moe.experts"]) == paths[::2]
    assert resolve_ep_plan(model, moe_own.experts_of, ep=2) == paths
    with pytest.raises(ValueError, match=r"^Pipeline.ep_plan: 'layers\.\*\.experts' names no module of TinyMoE$"):
        resolve_ep_plan(model, ["layers.*.moe.experts", "layers.*.experts"])
    with pytest.raises(ValueError, match="names no experts module of TinyMoE"):
        resolve_ep_plan(model, [])


def test_resolve_ep_plan_reads_the_number_of_experts_off_the_parameters():
    """Without num_experts, the leading dimension all parameters share is the number of experts;
    parameters that share none, or one that does not lead with num_experts, are refused naming it."""
    from torch import nn

    model = moe_own.TinyMoE(moe_own.Model(experts=6, layers=1))
    experts = model.layers[0].moe.experts
    del experts.num_experts
    assert resolve_ep_plan(model, ["layers.0.moe.experts"], ep=3) == ["layers.0.moe.experts"]
    with pytest.raises(ValueError, match="has 6 experts, which 4 ranks cannot hold in equal shares"):
        resolve_ep_plan(model, ["layers.0.moe.experts"], ep=4)
    experts.w_out = nn.Parameter(experts.w_out.detach()[:5])
    with pytest.raises(ValueError, match=r"share no leading dimension \(w_in \(6, 16, 8\), w_out \(5, 8, 16\)\)"):
        resolve_ep_plan(model, ["layers.0.moe.experts"])
    experts.num_experts = 6
    with pytest.raises(
        ValueError, match=r"layers.0.moe.experts.w_out has shape \(5, 8, 16\), no leading dimension of 6"
    ):
        resolve_ep_plan(model, ["layers.0.moe.experts"])


def _tiny_config(family: str):
    from transformers import LlamaConfig, MixtralConfig, Qwen2MoeConfig

    common = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    common |= {"num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 1}
    if family == "qwen2_moe":
        moe = {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "num_experts": 4}
        return Qwen2MoeConfig(**common, intermediate_size=64, num_experts_per_tok=2, **moe)
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)
    return LlamaConfig(**common, intermediate_size=64)


def _saved(family: str, folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers import hf_tiny

    torch.manual_seed(0)
    return hf_tiny.save(AutoModelForCausalLM.from_config(_tiny_config(family)), folder)


@pytest.mark.parametrize(("family", "key"), [("qwen2_moe", "num_experts"), ("mixtral", "num_local_experts")])
def test_the_hf_pipeline_reads_its_experts_from_config_json(family, key, tmp_path, capsys, no_work):
    """`raylane check hf`: ep 3 does not divide the 4 experts (the key config.json gives them by),
    ep 2 passes (transformers' plan resolved on the model built on the meta device: each layer's
    experts), and a dense Llama is refused at any ep."""
    from tests.helpers import hf_tiny

    pytest.importorskip("transformers")
    data = hf_tiny.rows(tmp_path / "data", n=8)
    folder = _saved(family, tmp_path / family)

    def check(path: Path, *sets: str) -> tuple[int, str]:
        argv = ["check", "hf", "--set", f"model.name_or_path={path}", "--set", f"data.train={data / 'train.jsonl'}"]
        argv += [
            "--set",
            "mlflow.enabled=false",
            "--set",
            "strategy.name=fsdp",
            *[x for s in sets for x in ("--set", s)],
        ]
        capsys.readouterr()
        code = cli.main(argv)
        return code, capsys.readouterr().err.strip()

    code, err = check(folder, "strategy.ep=3", "scaling.num_workers=3")
    assert (code, err) == (
        2,
        f"raylane: invalid config: strategy.ep = 3: does not divide the 4 experts of the {family!r} model ({key} in "
        f"{folder / 'config.json'}), which each of the ep ranks holds an equal share of",
    )
    assert check(folder, "strategy.ep=2") == (0, "")
    llama = _saved("llama", tmp_path / "llama")
    code, err = check(llama, "strategy.ep=2")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(
        f"raylane: invalid config: strategy.ep = 2: model.name_or_path = '{llama}' is a dense 'llama'"
    )


def test_the_hf_plan_names_each_layers_experts_under_the_base_and_peft_prefixes():
    """transformers' base_model_ep_plan keys marked ep_dispatch_experts, under the causal LM's
    base model (`model.`) and peft's wrapper (`base_model.model.`); none for a dense model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from raylane.hf.experts import ep_plan

    for family in ("qwen2_moe", "mixtral"):
        model = AutoModelForCausalLM.from_config(_tiny_config(family))
        assert ep_plan(model) == ["model.layers.*.mlp.experts"]
        assert resolve_ep_plan(model, ep_plan, ep=4) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    lora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert resolve_ep_plan(lora, ep_plan, ep=2) == [f"base_model.model.model.layers.{i}.mlp.experts" for i in (0, 1)]
    assert ep_plan(AutoModelForCausalLM.from_config(_tiny_config("llama"))) == []


def test_check_layout_without_ep_is_unchanged(config):
    """ep 1 (the default) adds no check: an odd world still passes as before."""
    cfg = load_config(str(config), ["scaling.num_workers=3"])
    layout_checks.check_layout(cfg, 3, "scaling.num_workers = 3")
