"""Pipeline parallelism's pieces in one process: the split into stages (names kept, `auto` on gpt
and on a model written the natural way, the errors of a split that cannot work), which rank holds
which stage, the data by data-parallel rank, the layout's name, and the config's checks. The
schedules themselves, on gloo ranks, are tests/e2e/test_pipeline_parallel.py's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raylane.config import load_config
from raylane.errors import ConfigError
from raylane.loop.data.loader import data_ranks
from raylane.loop.distributed.blocks import find_blocks
from raylane.loop.distributed.fsdp import Strategy
from raylane.loop.distributed.layout import Layout
from raylane.loop.distributed.pipeline_parallel import PipelineModel, stage_module, stage_ranks
from raylane.loop.distributed.pipeline_split import auto_stages, check_stages


class Natural(nn.Module):
    """A decoder written with no thought of stages, its blocks one level down (GPT-2's shape):
    input modules, a loop over the blocks, a head; a parameter-free rotary-like table every block reads."""

    def __init__(self, layers: int = 4, tied: bool = False) -> None:
        super().__init__()
        self.body = nn.Module()
        self.body.embed = nn.Embedding(16, 8)
        self.body.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers))
        self.body.norm = nn.LayerNorm(8)
        self.scale = nn.Identity()  # parameter-free: every stage keeps it
        self.head = nn.Linear(8, 16, bias=False)
        if tied:
            self.head.weight = self.body.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.scale(self.body.embed(idx))
        for layer in self.body.layers:
            x = layer(x)
        return self.head(self.body.norm(x))


def _chain(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


def _split(model: nn.Module, n: int) -> tuple[list[list[str]], list[nn.Module]]:
    names = auto_stages(model, find_blocks(model), n)
    check_stages(model, names, n)
    container = names[1][0].rpartition(".")[0]
    return names, [stage_module(model, names, i, container) for i in range(n)]


@pytest.mark.parametrize("n", [2, 4])
def test_auto_splits_a_natural_model_keeping_its_names(n):
    """The blocks split evenly, what comes before them on the first stage and after them on the
    last (the innermost holder's first, as the forward meets them); each stage holds its own
    parameters under the model's names, every parameter on exactly one stage, and the stages
    chained compute the model's forward."""
    torch.manual_seed(0)
    model = Natural()
    names, stages = _split(model, n)
    assert names[0][0] == "body.embed" and names[-1][-3:] == ["body.norm", "scale", "head"]
    assert [sum(1 for x in s if x.startswith("body.layers.")) for s in names] == [4 // n] * n
    held = [dict(s.named_parameters()) for s in stages]
    everything = dict(model.named_parameters())
    assert sorted(k for h in held for k in h) == sorted(everything)
    assert all(torch.equal(p, everything[k]) for h in held for k, p in h.items())
    idx = torch.randint(16, (2, 5))
    assert torch.allclose(_chain(stages, idx), model(idx))
    merged = PipelineModel(stages[:2], None)  # two stages on one rank: one model, the same names
    assert sorted(k for k, _ in merged.named_parameters()) == sorted(k for h in held[:2] for k in h)


def test_auto_splits_gpt_by_its_blocks():
    """The shipped gpt pipeline (untied): wte, wpe and the first blocks; the last blocks, ln_f
    and lm_head; the chained stages give the model's logits."""
    from raylane.pipelines.gpt import build

    cfg = load_config("gpt-tiny", ["model.tie_embeddings=false", "model.n_layer=4"])
    pipe = build(cfg)
    assert pipe.pp_stages == "auto"
    names, stages = _split(pipe.model, 2)
    assert names == [["wte", "wpe", "drop", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "ln_f", "lm_head"]]
    idx = torch.randint(256, (2, cfg.model.block_size))
    assert torch.allclose(_chain(stages, idx), pipe.model(idx), atol=1e-6)


def test_a_split_that_cannot_work_says_why():
    model = Natural(layers=2)
    with pytest.raises(ValueError, match=r"'auto': 4 stages for the 2 blocks of Natural"):
        auto_stages(model, find_blocks(model), 4)
    tied = Natural(tied=True)
    with pytest.raises(
        ValueError, match=r"'body.embed.weight' and 'head.weight' are one tied parameter, which stages 0 and 1"
    ):
        check_stages(tied, auto_stages(tied, find_blocks(tied), 2), 2)
    given = [["body.embed", "body.layers.0"], ["body.layers.1", "head"]]  # body.norm left out
    with pytest.raises(ValueError, match=r"no stage holds the parameter 'body.norm.weight'"):
        check_stages(model, given, 2)
    with pytest.raises(ValueError, match=r"'body.lm' names no module of Natural"):
        check_stages(model, [["body.lm"], ["head"]], 2)
    with pytest.raises(ValueError, match=r"3 stages, for the 2 stages"):
        check_stages(model, [["head"]] * 3, 2)
    model.register_parameter("bias", nn.Parameter(torch.zeros(1)))
    with pytest.raises(ValueError, match=r"'bias' is a parameter of Natural itself"):
        auto_stages(model, find_blocks(model), 2)
    with pytest.raises(ValueError, match=r"no repeated blocks found in Linear"):
        auto_stages(nn.Linear(2, 2), find_blocks(nn.Linear(2, 2)), 2)


def test_stages_by_rank_and_data_by_data_parallel_rank():
    """Looped schedules: rank r holds r, r + pp; V-shaped ones: r and 2 pp - 1 - r. A pipeline's
    stages read the same batches: on (pp 2, dp 2, tp 2) ranks 1 and 5 (and 0, 4) are dp rank 0."""
    assert stage_ranks(2, 1, False) == [0, 1]
    assert stage_ranks(2, 2, False) == [0, 1, 0, 1]
    assert stage_ranks(2, 2, True) == [0, 1, 1, 0]

    class Runtime:
        world_size = 8
        rank = 0

    seen = {}
    for rank in range(8):
        Runtime.rank = rank
        data = data_ranks(Runtime(), Layout("fsdp", pp=2, dp_shard=2, tp=2))
        seen[rank] = (data.rank, data.world_size)
    assert seen == {0: (0, 2), 1: (0, 2), 2: (1, 2), 3: (1, 2), 4: (0, 2), 5: (0, 2), 6: (1, 2), 7: (1, 2)}


def test_the_layout_names_itself():
    assert Strategy(Layout("fsdp", pp=2), pp_schedule="1F1B").label == "pp2"
    s = Strategy(Layout("fsdp", pp=2, dp_shard=2, tp=2), pp_schedule="GPipe")
    assert s.label == "fsdp×tp2×pp2" and s.data_parallel == 2
    tags = s.tags()
    assert tags["raylane.strategy.mesh"] == "pp 2, dp_shard 2, tp 2" and tags["raylane.strategy.pp_schedule"] == "GPipe"


def test_config_defaults_and_a_stream_refused(tmp_path):
    """Stages per rank and micro-batches follow the schedule; a streaming pipeline is refused
    under PP before launch (its Ray Data split is by world rank)."""
    from raylane import layout_checks

    s = load_config("gpt-tiny", ["strategy.pp=2", "model.tie_embeddings=false"]).strategy
    assert (s.stages_per_rank, s.microbatches) == (1, 2)
    s = load_config(
        "gpt-tiny", ["strategy.pp=2", "strategy.pp_schedule=DualPipeV", "model.tie_embeddings=false", "model.n_layer=4"]
    ).strategy
    assert (s.stages_per_rank, s.microbatches) == (2, 4)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({**{f"x{i}": [0.0, 1.0] for i in range(4)}, "label": [0, 1]}), tmp_path / "t.parquet")
    cfg = load_config("tabular", [f"data.train={tmp_path / 't.parquet'}", "strategy.pp=2"])
    with pytest.raises(ConfigError, match=r"strategy.pp = 2: the tabular pipeline streams its data \(sources\)"):
        layout_checks.check_layout(cfg, 2, "2 ranks")


def test_an_epoch_under_a_pipeline_runs_whole_batches_only():
    """A schedule's shapes are fixed: the last, partial batch is left out and not counted (in the
    rank's own process and through the workers' batch sampler), and a batch of another form is
    refused in one line."""
    from torch.utils.data import TensorDataset

    from raylane.loop.data.loader import _SeededBatches, build_loader
    from raylane.loop.distributed.pipeline_parallel import pair
    from raylane.loop.protocols.batches import BatchFormError

    rows = TensorDataset(torch.arange(10.0), torch.arange(10.0))
    loader = build_loader(rows, batch_size=4, rank=0, world_size=1, seed=0, shuffle=False, whole_batches=True)
    assert loader.batches_in_epoch(0) == 2 and [len(x) for x, _ in loader] == [4, 4]
    seeded = _SeededBatches(loader.order, 4, (0,), whole=True)
    assert len(seeded) == 2 and [len(b) for b in seeded] == [4, 4]
    assert build_loader(rows, batch_size=4, rank=0, world_size=1, seed=0, shuffle=False).batches_in_epoch(0) == 3
    with pytest.raises(BatchFormError, match=r"runs \(input, target\) batches of two tensors .* dict with keys \[x\]"):
        pair({"x": torch.zeros(1)})


def test_stages_given_by_name_split_where_the_pipeline_says():
    torch.manual_seed(0)
    model = Natural()
    given = [["body.embed", "body.layers.0"], ["body.layers.1", "body.layers.2", "body.layers.3", "body.norm", "head"]]
    stages = [stage_module(model, check_stages(model, given, 2), i, "body.layers") for i in range(2)]
    assert [len(list(s.body.layers)) for s in stages] == [2, 4]  # with Exit, with Enter
    assert sorted(n for n, _ in stages[0].named_parameters()) == [
        "body.embed.weight",
        "body.layers.0.0.bias",
        "body.layers.0.0.weight",
    ]
    idx = torch.randint(16, (3, 4))
    assert torch.allclose(_chain(stages, idx), model(idx))


def test_dp_replicate_makes_fsdp_hsdp_without_model_parallelism():
    from raylane.loop.distributed.parallelize import choose_strategy

    cfg = load_config("gpt-tiny", ["strategy.name=fsdp", "strategy.dp_replicate=2"])
    chosen = choose_strategy(cfg, torch.device("cpu"), 4, nn.Linear(1, 1), None, None)
    assert (chosen.name, chosen.mesh_shape) == ("hsdp", (2, 2))


def test_auto_splits_a_sequential_model_with_its_activations():
    """A Sequential model's weighted layers are its blocks; each activation goes with the layer
    before it, so that no stage applies it twice."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    names = auto_stages(model, find_blocks(model), 2)
    assert names == [["0", "1", "2", "3"], ["4"]]
    stages = [stage_module(model, check_stages(model, names, 2), i, "") for i in range(2)]
    x = torch.randn(3, 4)
    assert torch.allclose(_chain(stages, x), model(x))
    from raylane.loop.distributed.pipeline_split import check_container

    with pytest.raises(ValueError, match=r"'1', between the blocks, is on no stage"):
        check_container(model, [["0", "2", "3"], ["4"]], "")


def _natural_gpt(**fields):
    from tests.helpers.natural_gpt import ModelSection, build_model

    torch.manual_seed(0)
    return build_model(ModelSection(**fields))


def test_every_stage_runs_the_model_s_forward_on_the_model_s_own_input():
    """nanoGPT's forward (`B, T = idx.shape`, a position embedding of `arange(T)`) on a later stage:
    the stage is handed the micro-batch's own input beside the activation it received (the
    schedule's keyword, which torch splits into micro-batches for every stage), so the chained
    stages compute the model's output. Seen failing before: a later stage called with the hidden
    state, as it was, raises `too many values to unpack (expected 2)` at `B, T = idx.shape`."""
    from raylane.loop.distributed.pipeline_parallel import MODEL_INPUT

    model = _natural_gpt(n_layer=4)
    names, stages = _split(model, 2)
    idx = torch.randint(64, (3, 16))
    x = idx
    for stage in stages:
        x = stage(x, **{MODEL_INPUT: idx})
    assert torch.allclose(x, model(idx), atol=1e-6)
    with pytest.raises(ValueError, match="too many values to unpack"):
        stages[1](stages[0](idx))  # the hidden state alone, as the model's input


def test_a_module_held_elsewhere_gives_zeros_of_its_own_shape():
    """What another stage holds returns zeros shaped as its output would be (a stride-0 view), so
    a forward reading the embedding's shape (`B, T, C = x.shape`) runs on every stage."""

    class ReadsShape(Natural):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.body.embed(idx)
            b, t, c = x.shape
            for layer in self.body.layers:
                x = layer(x)
            return self.head(self.body.norm(x)).view(b, t, -1)

    from raylane.loop.distributed.pipeline_parallel import MODEL_INPUT, Elsewhere

    torch.manual_seed(0)
    model = ReadsShape()
    _, stages = _split(model, 2)
    assert isinstance(stages[1].body.embed, Elsewhere)
    zeros = stages[1].body.embed(torch.zeros(3, 5, dtype=torch.long))
    assert zeros.shape == (3, 5, 8) and zeros.stride() == (0, 0, 0) and not zeros.any()
    assert not list(stages[1].body.embed.parameters())
    idx = torch.randint(16, (3, 5))
    out = stages[1](stages[0](idx, **{MODEL_INPUT: idx}), **{MODEL_INPUT: idx})
    assert torch.allclose(out, model(idx))


def test_stages_a_forward_cannot_run_in_turn_are_refused_before_launch():
    """The forward check runs the stages one after the other on the meta device before launch:
    nanoGPT's model passes (every stage gets the model's own input), and a forward that reaches its
    blocks by index (`self.blocks[i]` for i in range(n_layer): the first stage holds blocks 0 and 1
    only) is refused in one line naming strategy.pp, the stage, the user's file:line (where the
    model's class is defined) and what a stage runs."""
    from raylane.loop.distributed.forward_checks import check_model_parallel, check_pp_forward
    from tests.helpers import natural_gpt

    cfg = natural_gpt.Config(pipeline=natural_gpt.__file__, strategy={"pp": 2}, model={"n_layer": 4})
    pipe = natural_gpt.build(cfg)
    check_model_parallel(pipe, cfg)

    class ByIndex(type(pipe.model)):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
            for i in range(4):
                x = self.blocks[i](x)
            return self.lm_head(self.ln_f(x))

    model = pipe.model
    model.__class__ = ByIndex
    names, _ = _split(model, 2)
    with pytest.raises(ValueError) as failed:
        check_pp_forward(model, names, "blocks", pipe.example_input, 2)
    line = str(failed.value)
    assert line.startswith("strategy.pp = 2: stage 0 of ByIndex's forward fails (") and "\n" not in line
    assert "tests/unit/test_pipeline_parallel.py:" in line and "IndexError: index 2 is out of range" in line
    assert "a stage runs the model's own forward on the model's input, with the blocks of 'blocks'" in line
