"""A tensor-parallel plan's styles given by name (raylane.loop.distributed.tp_styles): transformers' names
read as torch's styles of the same split, everything else refused in one line naming the rule."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from raylane.errors import ConfigError
from raylane.loop.distributed.tp_styles import STYLES, Whole, resolve_rules, resolve_style, style_name

KEY = "Pipeline.tp_plan['blocks.*.attn.q_proj']"


@pytest.mark.parametrize(
    ("name", "kind", "inputs", "outputs"),
    [
        ("colwise", ColwiseParallel, Replicate(), Shard(-1)),
        ("colwise_rep", ColwiseParallel, Replicate(), Replicate()),
        ("colwise_gather_output", ColwiseParallel, Replicate(), Replicate()),
        ("rowwise", RowwiseParallel, Shard(-1), Replicate()),
        ("rowwise_rep", RowwiseParallel, Replicate(), Replicate()),
        ("rowwise_split_input", RowwiseParallel, Replicate(), Replicate()),
        ("embedding_rowwise", RowwiseParallel, Replicate(), Replicate()),
        ("embedding_colwise", ColwiseParallel, Replicate(), Replicate()),
    ],
)
def test_a_named_style_is_torchs_style_of_the_same_split(name, kind, inputs, outputs):
    """transformers registers each name with these layouts (ALL_PARALLEL_STYLES)."""
    style = resolve_style(name, KEY)
    assert type(style) is kind
    assert tuple(style.input_layouts) == (inputs,)
    assert tuple(style.output_layouts) == (outputs,)
    assert style_name(style) == name


def test_sequence_parallel_and_replicate():
    sp = resolve_style("sequence_parallel", KEY)
    assert type(sp) is SequenceParallel and not sp.use_local_output  # its DTensor carries Shard(1) on
    whole = resolve_style("replicate", KEY)
    assert isinstance(whole, Whole)
    module = object()
    assert whole._apply(module, None) is module


def test_a_style_made_in_code_is_taken_as_it_is():
    style = ColwiseParallel(output_layouts=Replicate())
    assert resolve_style(style, KEY) is style
    assert style_name(style) is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "colwize",
            r"^Pipeline.tp_plan\['blocks.\*.attn.q_proj'\] = 'colwize': no such style \(did you mean 'colwise'\?\); give one of 'colwise', .*'replicate', or a torch ParallelStyle$",
        ),
        ("Colwise", r"= 'Colwise': no such style \(did you mean 'colwise'\?\)"),
        ("zzz", r"= 'zzz': no such style; give one of 'colwise'"),
        (
            "local_colwise",
            r"= 'local_colwise': a transformers style raylane does not lay out with torch's styles \(it keeps plain tensors",
        ),
        ("packed_colwise", r"= 'packed_colwise': a transformers style .* fused projection"),
        (ColwiseParallel, r"= ColwiseParallel: the class, not a style; give ColwiseParallel\(\) \(called\)$"),
        (3, r"= 3: not a style; give a torch ParallelStyle"),
        (None, r"= None: not a style"),
    ],
)
def test_anything_else_is_refused_in_one_line_naming_the_rule(value, message):
    with pytest.raises(ConfigError, match=message) as caught:
        resolve_style(value, KEY)
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith(KEY)


def test_every_name_is_listed_and_resolves():
    for name in STYLES:
        resolve_style(name, KEY)


def test_a_plans_rules_are_named_by_their_pattern():
    rules = resolve_rules({"wte": "embedding_rowwise", "lm_head": ColwiseParallel()})
    assert type(rules["wte"]) is RowwiseParallel
    with pytest.raises(ConfigError, match=r"^Pipeline.tp_plan\['lm_head'\] = 'colwize'"):
        resolve_rules({"wte": "embedding_rowwise", "lm_head": "colwize"})
