"""The plan and stage checks before launch (raylane.layout_checks.check_plan, through
raylane.loop.plan_view) on a user's own pipeline and a Hugging Face model in it
(tests/helpers/plan_mistakes.py), in one process: each mistake of issue 60's finding 2 one line
naming the rule or the key, what is right passing, and the model built on the meta device while
the data code reads values (raylane.loop.meta_build). The same checks through the commands, on
Ray and under torchrun, are tests/e2e/test_plan_checks.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raylane.config import ConfigError, load_config
from raylane.layout_checks import check_plan
from raylane.loop import meta_build
from raylane.loop.plan_view import pipeline_plan

HELPER = "tests.helpers.plan_mistakes"
TP2 = ["strategy.tp=2", "scaling.num_workers=2"]
PP2 = ["strategy.pp=2", "scaling.num_workers=2"]


def _cfg(*sets: str):
    return load_config({"pipeline": HELPER}, list(sets))


def _refused(*sets: str) -> str:
    cfg = _cfg(*sets)
    with pytest.raises(ConfigError) as caught:
        check_plan(cfg, cfg.scaling.num_workers)
    text = str(caught.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            [*TP2, "model.heads=3"],
            "strategy.tp = 2: does not divide layers.0.attn.n_heads = 3, the heads each rank takes a share of "
            "(Pipeline.tp_plan['layers.*.attn.q_proj'] splits layers.0.attn.q_proj by columns)",
        ),
        ([*TP2, "model.plan=no_module"], "Pipeline.tp_plan: 'layers.*.attn.out_projection' names no module of TinyLM"),
        (
            [*TP2, "model.plan=misspelt"],
            "Pipeline.tp_plan['layers.*.attn.q_proj'] = 'colwize': no such style (did you mean 'colwise'?); give one "
            "of 'colwise', 'colwise_rep', 'colwise_gather_output', 'rowwise', 'rowwise_rep', 'rowwise_split_input', "
            "'embedding_rowwise', 'embedding_colwise', 'sequence_parallel', 'replicate', or a torch ParallelStyle",
        ),
        (
            [*TP2, "model.plan=conv"],
            "Pipeline.tp_plan['layers.*.conv'] = RowwiseParallel: splits a Linear or an Embedding only, and takes "
            "Conv1d; name its Linear layers",
        ),
        (
            [*TP2, "model.tied=true"],
            "Pipeline.tp_plan: embed.weight and head.weight are one tied parameter, which the plan lays out as "
            "whole and Shard(0); give both the same sharding",
        ),
        (
            [*PP2, "model.tied=true"],
            "strategy.pp = 2: Pipeline.pp_stages: 'embed.weight' and 'head.weight' are one tied parameter, which "
            "stages 0 and 1 would hold apart (and train apart); untie them, or keep both on one stage",
        ),
        (
            ["strategy.pp=4", "scaling.num_workers=4", "strategy.name=fsdp", "model.layers=3"],
            "strategy.pp = 4: Pipeline.pp_stages = 'auto': 4 stages for the 3 blocks of TinyLM",
        ),
        (
            [*PP2, "model.layers=1"],
            "strategy.pp = 2: Pipeline.pp_stages = 'auto': 2 stages for the 1 block of TinyLM (layers.0)",
        ),
    ],
)
def test_each_mistake_of_a_users_own_pipeline_is_one_line(sets, line):
    """Before: `raylane train` ran none of these (plain check passed the plan naming no module;
    --plan showed a string style as `str`, every weight whole), and the ranks failed after
    48-78 s; the heads, the string and the Conv1d reached torch's own errors."""
    assert _refused(*sets) == line


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (
            [*TP2, "model.plan=hf", "model.heads=3"],
            "strategy.tp = 2: does not divide model.layers.0.self_attn.config.num_attention_heads = 3, the heads "
            "each rank takes a share of (Pipeline.tp_plan['model.layers.*.self_attn.q_proj'] splits "
            "model.layers.0.self_attn.q_proj by columns)",
        ),
        (
            [*TP2, "model.plan=misspelt"],
            "Pipeline.tp_plan['model.layers.*.self_attn.q_proj'] = 'colwize': no such style (did you mean 'colwise'?)",
        ),
        (
            [*PP2, "model.plan=hf", "model.tied=true"],
            "strategy.pp = 2: Pipeline.pp_stages: 'model.embed_tokens.weight' and 'lm_head.weight' are one tied "
            "parameter, which stages 0 and 1 would hold apart",
        ),
        (
            ["strategy.pp=4", "scaling.num_workers=4", "strategy.name=fsdp", "model.plan=hf", "model.layers=3"],
            "strategy.pp = 4: Pipeline.pp_stages = 'auto': 4 stages for the 3 blocks of LlamaForCausalLM",
        ),
    ],
)
def test_a_hugging_face_model_in_a_users_pipeline_is_checked_alike(sets, line):
    pytest.importorskip("transformers")
    assert _refused(*sets, "model.kind=hf").startswith(line)


def test_what_is_right_passes_and_string_styles_are_shown_as_their_split():
    """transformers' notation is taken (its names torch's styles make exactly): shown as the
    split it makes, not as `str` with every weight whole."""
    assert check_plan(_cfg(*TP2), 2) == []
    lines = pipeline_plan(_cfg(*TP2, "model.plan=strings"), 2)
    assert "  layers.*.attn.q_proj    colwise: weight Shard(0); in Replicate, out Shard(-1)  (×2)" in lines
    assert "  layers.*.attn.out_proj  rowwise: weight Shard(1); in Shard(-1), out Replicate  (×2)" in lines
    assert check_plan(_cfg(*PP2), 2) == []
    assert check_plan(_cfg("strategy.tp=2", "strategy.pp=2", "scaling.num_workers=4", "strategy.name=fsdp"), 4) == []
    pytest.importorskip("transformers")
    for plan in ("hf", "strings"):
        assert check_plan(_cfg(*TP2, "model.kind=hf", f"model.plan={plan}"), 2) == []


def test_heads_are_checked_only_where_a_plan_splits_them():
    """A plan that splits the MLPs alone gives each rank every head: 3 heads pass at tp 2; with
    `tp: auto` the degree is the ranks' choice (the heads decide which they try)."""
    from raylane.loop.plan_view import plan_lines
    from tests.helpers.plan_mistakes import Model, TinyLM

    model = TinyLM(16, Model(heads=3))
    mlp = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}
    assert plan_lines(model, mlp, sequence_parallel=False, tp=2)[0] == "plan on TinyLM (2 rules):"
    with pytest.raises(ValueError, match=r"^strategy.tp = 2: does not divide layers.0.attn.n_heads = 3"):
        plan_lines(model, {**mlp, "layers.*.attn.k_proj": "colwise"}, sequence_parallel=False, tp=2)
    assert check_plan(_cfg("strategy.tp=auto", "strategy.name=fsdp", "scaling.num_workers=2", "model.heads=3"), 2) == []


def test_the_model_is_built_on_the_meta_device_and_the_data_as_on_a_rank():
    """build() reads its data's values (`tokens.max().item()`, as examples/own-model's `int(k)`):
    before, the whole build() ran on the meta device and failed with `Tensor.item() cannot be
    called on meta tensors`; now only what the modules' constructors make is meta."""
    pipe = meta_build.build_for_checks(_cfg(*TP2))
    assert all(p.is_meta for p in pipe.model.parameters())
    assert not pipe.train_set.tensors[0].is_meta and pipe.train_set.tensors[0].max() == 31
    with meta_build.modules_on_meta():
        assert torch.ones(2).device.type == "cpu"
        assert nn.Linear(2, 2).weight.is_meta


class _Rates(nn.Module):
    """A constructor that reads values (timm's drop-path rates): it cannot be built on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.rates = [float(r) for r in torch.linspace(0, 0.1, 4).tolist()]
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in self.rates)


def test_a_model_whose_constructor_reads_values_is_built_on_the_cpu_within_a_cap(tmp_path, monkeypatch):
    (tmp_path / "rates.py").write_text(
        "import raylane, torch\nfrom tests.unit.test_plan_checks import _Rates\n"
        "class Config(raylane.BaseConfig):\n    pass\n"
        "def build(cfg):\n    m = _Rates()\n"
        "    return raylane.Pipeline(model=m, train_set=torch.utils.data.TensorDataset(torch.zeros(4, 64)),"
        " loss_fn=lambda o, t: o.sum(), tp_plan={'blocks.*': 'colwise'})\n"
    )
    cfg = load_config({"pipeline": str(tmp_path / "rates.py")}, TP2)
    pipe = meta_build.build_for_checks(cfg)
    assert not any(p.is_meta for p in pipe.model.parameters())  # built on the CPU: 4 x 64 x 65 floats
    monkeypatch.setattr(meta_build, "CPU_CAP_BYTES", 50_000)
    with pytest.raises(
        meta_build.Unchecked,
        match=r"raised NotImplementedError: Cannot copy out of meta tensor.*; and its constructors make over 48.8 KiB on the CPU$",
    ):
        meta_build.build_for_checks(cfg)
    # Not the user's mistake: the run goes on, and says the plan was not looked at.
    (note,) = check_plan(cfg.model_copy(update={"run": cfg.run.model_copy(update={"name": "other"})}), 2)
    assert note.startswith("raylane: the plan and stages are not checked before launch: pipeline ")


def test_a_build_that_fails_here_is_said_and_its_own_refusal_refused(tmp_path):
    """build() raising on this machine (a file only the ranks see) is a note, not a refusal; a
    ConfigError it raises is the config's mistake on every rank: refused before launch."""
    (tmp_path / "fails.py").write_text(
        "import raylane\nclass Config(raylane.BaseConfig):\n    kind: str = 'os'\n"
        "def build(cfg):\n    if cfg.kind == 'os':\n        open('/nonexistent/data.bin')\n"
        "    raise raylane.ConfigError('kind = \"config\": no such kind')\n"
    )
    (note,) = check_plan(load_config({"pipeline": str(tmp_path / "fails.py")}, TP2), 2)
    assert note.startswith("raylane: the plan and stages are not checked before launch: pipeline ")
    assert "FileNotFoundError" in note and "fails.py:6" in note
    # As the config's own checks say theirs (raylane.pipelines_ref.bad_input): `raylane: invalid config: ...`.
    with pytest.raises(ConfigError, match=r"^invalid config: kind = \"config\": no such kind$"):
        check_plan(load_config({"pipeline": str(tmp_path / "fails.py"), "kind": "config"}, TP2), 2)


def test_no_build_without_tp_or_pp(tmp_path):
    (tmp_path / "never.py").write_text(
        "import raylane\nclass Config(raylane.BaseConfig):\n    pass\ndef build(cfg):\n    raise SystemExit(9)\n"
    )
    assert check_plan(load_config({"pipeline": str(tmp_path / "never.py")}), 2) == []


def test_a_factory_wrapped_for_a_while_by_a_library_is_still_put_on_meta(monkeypatch):
    """transformers' loading puts its own `_safe_linspace` in place of torch.linspace for a while;
    torch's cached list of factories, first made then, kept the wrapper, and a constructor's real
    linspace after it went unredirected: a model that reads values was built on meta (seen in make
    test, after an HF test on the same worker)."""
    from torch.utils import _device

    real = torch.linspace

    def _safe_linspace(*args, **kwargs):
        return real(*args, **kwargs)

    _device._device_constructors.cache_clear()
    monkeypatch.setattr(torch, "linspace", _safe_linspace)
    _device._device_constructors()  # torch's list, made while the wrapper is in place
    monkeypatch.setattr(torch, "linspace", real)
    try:
        with pytest.raises(NotImplementedError, match="meta"), meta_build.modules_on_meta():
            _Rates()
    finally:
        _device._device_constructors.cache_clear()
