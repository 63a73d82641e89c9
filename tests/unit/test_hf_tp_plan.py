"""A Hugging Face model's own tensor-parallel plan as torch's styles (raylane.hf.tensor_parallel), and what
`raylane check --plan` prints of a plan (raylane.loop.plan_view), on models built on the meta
device: no process group, no weights. The plans applied on 2 and 4 gloo ranks are
tests/e2e/test_hf_tp.py's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: E402

from raylane.hf.lora import LoraSection, apply_lora  # noqa: E402
from raylane.hf.tensor_parallel import check_tp, tp_plan  # noqa: E402
from raylane.loop.plan_view import layout_line, plan_lines  # noqa: E402
from tests.helpers import hf_families  # noqa: E402


def _meta(family: str = "llama", **extra):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_families.CONFIGS[family](**extra))


def _deepseek_v2():
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    shapes = {"kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}
    config = DeepseekV2Config(
        **{**hf_families.DECODER, "num_key_value_heads": 4, "intermediate_size": 64, "moe_intermediate_size": 16},
        **{"n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 0, **shapes},
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _kind(style) -> tuple[str, tuple, tuple]:
    return type(style).__name__, style.input_layouts, style.output_layouts


def test_transformers_styles_become_torchs_of_the_same_split():
    """LLaMA's nine rules: q/k/v/gate/up by columns (outputs left split), o/down by rows (inputs
    split, outputs summed), the embedding by vocabulary rows from whole token ids, the head by
    columns with its logits gathered (colwise_gather_output)."""
    plan = tp_plan(_meta())
    layer = "model.layers.*."
    assert set(plan) == {
        "lm_head",
        "model.embed_tokens",
        *(layer + p for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")),
        *(layer + p for p in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
    }
    colwise = ("ColwiseParallel", (Replicate(),), (Shard(-1),))
    rowwise = ("RowwiseParallel", (Shard(-1),), (Replicate(),))
    assert _kind(plan[layer + "self_attn.q_proj"]) == _kind(plan[layer + "mlp.up_proj"]) == colwise
    assert _kind(plan[layer + "self_attn.o_proj"]) == _kind(plan[layer + "mlp.down_proj"]) == rowwise
    assert _kind(plan["lm_head"]) == ("ColwiseParallel", (Replicate(),), (Replicate(),))
    assert _kind(plan["model.embed_tokens"]) == ("RowwiseParallel", (Replicate(),), (Replicate(),))


def test_a_lora_adapter_is_split_with_its_layer():
    """Under peft's names: a column-split base's lora_B split by columns beside it (lora_A whole),
    a row-split base's lora_A split by rows (lora_B whole); each adapted layer by its full name,
    the rest of the plan as it was."""
    model = apply_lora(_meta(), LoraSection(r=4, target_modules=["q_proj", "o_proj"]), base="", key=None)
    plan = tp_plan(model)
    at = "base_model.model.model.layers.{}.self_attn."
    for i in (0, 1):
        q, o = at.format(i) + "q_proj.", at.format(i) + "o_proj."
        assert isinstance(plan[q + "base_layer"], ColwiseParallel) and isinstance(
            plan[q + "lora_B.default"], ColwiseParallel
        )
        assert isinstance(plan[o + "base_layer"], RowwiseParallel) and isinstance(
            plan[o + "lora_A.default"], RowwiseParallel
        )
        assert q + "lora_A.default" not in plan and o + "lora_B.default" not in plan
    assert isinstance(plan["base_model.model.model.layers.*.self_attn.k_proj"], ColwiseParallel)
    assert isinstance(plan["base_model.model.lm_head"], ColwiseParallel)
    assert len(plan) == 2 + 5 + 2 * 2 * 2


def test_what_cannot_be_laid_out_is_one_line_naming_it():
    """Heads that tp does not divide; a model without a plan (GPT-2); a style torch has no
    counterpart of here (DeepSeek-V2's latent attention); sequence parallelism, which transformers'
    plans lay out no norms for; dropout on a LoRA adapter's input under tp."""
    from raylane.hf.config import check_tensor_parallel

    with pytest.raises(ValueError) as heads:
        check_tp(_meta(), 3)
    assert str(heads.value) == (
        "strategy.tp = 3: does not divide the 4 attention heads of LlamaForCausalLM (config.num_attention_heads), "
        "which each rank takes a share of"
    )
    with pytest.raises(ValueError, match=r"^strategy.tp = 4: does not divide the 2 key value heads of Llama"):
        check_tp(_meta(), 4)
    with pytest.raises(ValueError, match=r"^strategy.tp = 2: GPT2LMHeadModel has no tensor-parallel plan "):
        check_tp(_meta("gpt2"), 2)
    with pytest.raises(ValueError) as mla:
        check_tp(_deepseek_v2(), 2)
    assert str(mla.value).startswith(
        "strategy.tp = 2: DeepseekV2ForCausalLM's plan lays out 'model.layers.*.self_attn.kv_a_proj_with_mqa' as "
        "'mla_kv_a_proj', a transformers style raylane has no torch counterpart of"
    )
    with pytest.raises(ValueError, match=r"^strategy.sequence_parallel = True: LlamaForCausalLM's plan"):
        check_tp(_meta(), 2, sequence_parallel=True)
    cfg = SimpleNamespace(model=None, strategy=SimpleNamespace(tp=2), lora=LoraSection(dropout=0.1))
    with pytest.raises(ValueError, match=r"^lora.dropout = 0.1 with strategy.tp = 2: dropout's masks"):
        check_tensor_parallel(cfg)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_keeps_its_experts_and_router_whole_on_each_tensor_parallel_rank(family):
    """transformers' plan splits fused experts in its own way (`moe_tp_experts`, `packed_colwise`),
    which torch has no counterpart of: the experts and the router stay whole on every rank of the
    group (FSDP still shards them over the data-parallel ranks), as Qwen2-MoE's shared expert,
    which its plan leaves out; attention is split as the plan says."""
    model = _meta(family)
    plan = check_tp(model, 2)
    assert not [name for name in plan if ".experts" in name or name.endswith("mlp.gate")], plan
    assert _kind(plan["model.layers.*.self_attn.q_proj"])[0] == "ColwiseParallel"
    assert _kind(plan["model.layers.*.self_attn.o_proj"])[0] == "RowwiseParallel"
    assert not [name for name in plan if ".mlp." in name], plan  # Qwen2-MoE's plan names no shared expert


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)) for _ in range(2))
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.wte.weight


def test_check_plan_lines_fold_blocks_and_refuse_a_tie_split_two_ways():
    """Each rule once, its blocks folded into `*` with their count; what no rule splits is whole;
    a tied pair split alike is named with its layout, split two ways it is refused (the run would
    refuse it after parallelizing)."""
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "blocks.*.1": ColwiseParallel(output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    lines = plan_lines(Tied(), plan, sequence_parallel=False)
    assert lines == [
        "plan on Tied (3 rules):",
        "  wte         rowwise: weight Shard(0); in Replicate, out Replicate",
        "  blocks.*.1  colwise: weight Shard(0); in Replicate, out Replicate  (×2)",
        "  lm_head     colwise: weight Shard(0); in Replicate, out Replicate",
        "whole on every tensor-parallel rank: blocks.*.0.weight (×2), blocks.*.0.bias (×2)",
        "tied: wte.weight = lm_head.weight (one parameter, Shard(0))",
    ]
    with pytest.raises(ValueError) as split:
        plan_lines(Tied(), {**plan, "lm_head": RowwiseParallel()}, sequence_parallel=False)
    assert str(split.value) == (
        "Pipeline.tp_plan: wte.weight and lm_head.weight are one tied parameter, which the plan lays out as "
        "Shard(0) and Shard(1); give both the same sharding"
    )


def test_the_layout_line_names_the_data_parallel_and_tensor_parallel_sizes():
    from raylane.config.sections import StrategySection

    def cfg(tp: int, name: str = "fsdp", sp: bool = False, pp: int = 1):
        return SimpleNamespace(strategy=StrategySection(tp=tp, name=name, sequence_parallel=sp, pp=pp))

    assert layout_line(cfg(2), 4) == "fsdp×tp2 on 4 ranks: dp 2 × tp 2"
    assert layout_line(cfg(2, sp=True), 2) == "tp2+sp on 2 ranks: dp 1 × tp 2"
    assert layout_line(cfg(1, "ddp"), 2) == "ddp on 2 ranks: dp 2 (strategy.tp = 1: every rank holds whole layers)"
    assert layout_line(cfg(1, "ddp"), 1).startswith("single on 1 rank: dp 1")
    assert layout_line(cfg(2, pp=2), 8) == "fsdp×tp2×pp2 on 8 ranks: dp 2 × tp 2 × pp 2"
