"""A model's blocks, the unit of FSDP sharding, activation checkpointing and compile: given by the
pipeline (modules, or a dotted path), else a Hugging Face model's `_no_split_modules`, else the
largest repeated ModuleList or Sequential; `raylane check --blocks` says what it found; FSDP on 2
ranks shards a model whose layers sit at `model.encoder.layers` per layer, and a model with none
as one unit, with a note."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

from raylane.cli import main
from raylane.config import load_config
from raylane.loop.distributed.blocks import find_blocks
from raylane.loop.distributed.parallelize import estimate_memory, parallelize
from raylane.loop.protocols.pipeline import Pipeline
from raylane.loop.usercode import pipeline_problem
from tests.conftest import REPO, TORCHRUN, read_json
from tests.helpers.nested_blocks import Layer, Net


class Expert(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)


class DecoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()  # listed too: inside a listed layer, not a unit of its own


class Base(nn.Module):
    _no_split_modules: ClassVar[list[str]] = [
        "DecoderLayer",
        "Attention",
    ]  # as a Hugging Face PreTrainedModel declares it

    def __init__(self) -> None:
        super().__init__()
        self.first = DecoderLayer()
        self.rest = nn.ModuleList([DecoderLayer(), DecoderLayer()])
        self.experts = nn.ModuleList([Expert(), Expert(), Expert()])  # the largest repeated list


class ForCausalLM(nn.Module):
    """Hugging Face's shape: the attribute on the base model, reached through `base_model`."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Base()
        self.lm_head = nn.Linear(8, 16)

    @property
    def base_model(self) -> nn.Module:
        return self.model


class Wrapper(nn.Module):
    """Exposes its inner model's layers under a second name, as a wrapper does."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Net()
        self.layers = self.inner.encoder.layers
        self.heads = nn.ModuleList([nn.Linear(64, 1), nn.Linear(64, 1)])  # repeated, but smaller


def test_the_pipeline_names_its_blocks_as_modules_or_a_dotted_path():
    model = Net()
    layers = list(model.encoder.layers)
    given = find_blocks(model, [model.embed, model.head])
    assert given.modules == [model.embed, model.head] and given.source == "the pipeline's blocks"
    assert given.describe() == "2 x Linear at the model (the pipeline's blocks)"
    assert find_blocks(model, model.encoder.layers).modules == layers
    assert find_blocks(model, [model.head, model.head]).modules == [model.head]  # sharded once
    path = find_blocks(model, "encoder.layers")
    assert path.modules == layers and path.describe() == "2 x Layer at encoder.layers (the pipeline's blocks)"
    # What is wrong with it is said when build(cfg) returns, naming the field.
    cases = {
        "encoder.nope": "blocks = 'encoder.nope' names no module of the model",
        "head": "blocks = 'head' is a Linear, not a ModuleList or Sequential",
        3: "blocks is int, not a list of the model's modules",
        (model.head, "x"): "blocks[1] is str, not a torch.nn.Module",
        (Layer(),): "blocks[0] (Layer) is not a module of the model",
        (model,): "blocks[0] is the model itself",
    }
    for blocks, expected in cases.items():
        problem = pipeline_problem(Pipeline(model=model, train_set=[1], loss_fn=len, eval_sums=len, blocks=blocks))
        assert problem is not None and problem.startswith(f"a Pipeline whose {expected}"), (blocks, problem)
    assert (
        pipeline_problem(Pipeline(model=model, train_set=[1], loss_fn=len, eval_sums=len, blocks="encoder.layers"))
        is None
    )


def test_found_at_model_blocks_in_no_split_modules_or_the_largest_repeated_list():
    hf = ForCausalLM()
    found = find_blocks(hf)
    base = hf.model
    assert found.modules == [base.first, *base.rest]  # the outermost listed modules, in order
    assert found.describe() == "3 x DecoderLayer at model, model.rest (_no_split_modules)"
    del Base._no_split_modules  # without it: the largest repeated list
    try:
        assert find_blocks(ForCausalLM()).describe() == "3 x Expert at model.experts (the largest repeated ModuleList)"
    finally:
        Base._no_split_modules = ["DecoderLayer", "Attention"]

    wrapped = Wrapper()
    found = find_blocks(wrapped)  # the list held under two names counts once; the heads are smaller
    assert found.modules == list(wrapped.inner.encoder.layers)
    assert found.describe() == "2 x Layer at inner.encoder.layers (the largest repeated ModuleList)"
    seq = nn.Module()
    seq.stem = nn.Linear(64, 64)
    seq.body = nn.Sequential(Layer(), Layer(), Layer())
    assert find_blocks(seq).modules == list(seq.body)

    # As before: model.blocks first, a Sequential model's layers with weights; else none.
    model = Net()
    model.blocks = nn.ModuleList([model.embed, model.head])  # model.blocks first, as before
    assert find_blocks(model).modules == [model.embed, model.head]
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert find_blocks(mlp).modules == [mlp[0], mlp[2]]
    none = nn.Module()
    none.a, none.b = nn.Linear(4, 8), nn.Linear(8, 2)
    none.acts = nn.ModuleList([nn.ReLU(), nn.ReLU()])  # repeated, but no weights
    none.mixed = nn.ModuleList([nn.Linear(2, 2), nn.LayerNorm(2)])  # not one class
    assert find_blocks(none).modules == []
    assert find_blocks(none).describe() == "none found (FSDP shards the whole model as one unit)"


def test_the_estimate_and_activation_checkpointing_use_the_found_blocks(caplog):
    """The memory estimate's largest gathered block is a layer's, not the whole model's; with no
    blocks, activation checkpointing says (once) that it recomputes nothing."""
    cfg = load_config(
        str(REPO / "pipelines/regression.yaml"), ["train.activation_checkpointing=true", "optim.name=adamw"]
    )
    model = Net()
    params = sum(p.numel() * 4 for p in model.parameters())
    layer = sum(p.numel() * 4 for p in model.encoder.layers[0].parameters())
    state = params * (2 + 2)  # adamw
    assert estimate_memory(model, cfg, 2, None, None)["fsdp"] == state // 2 + 2 * layer
    flat = nn.Sequential(nn.Flatten())  # no weights anywhere
    with caplog.at_level(logging.WARNING, logger="raylane"):
        for _ in range(2):
            parallelize(flat, cfg, torch.device("cpu"), 1)
    notes = [r.getMessage() for r in caplog.records if "no repeated blocks" in r.getMessage()]
    assert notes == [
        (
            "no repeated blocks found in Sequential: activation checkpointing recomputes nothing (give the "
            "pipeline blocks=[...] or blocks='path.to.layers' to choose them; docs/pipelines.md, Blocks)"
        )
    ]


@pytest.fixture
def project(tmp_path) -> Path:
    shutil.copy(REPO / "tests/helpers/nested_blocks.py", tmp_path / "pipe.py")
    (tmp_path / "cfg.yaml").write_text("pipeline: ./pipe.py\ntrain: {batch_size: 8, max_steps: 4}\n")
    return tmp_path


def test_check_prints_the_blocks_it_found(project, capsys):
    assert main(["check", str(project / "cfg.yaml"), "--blocks"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[-1]
        == "blocks: 2 x Layer at encoder.layers (the largest repeated ModuleList)"
    )
    assert main(["check", str(project / "cfg.yaml"), "--blocks", "--set", "model.kind=flat"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "blocks: none found (FSDP shards the whole model as one unit)"
    assert main(["check", str(project / "cfg.yaml"), "--blocks", "--set", "model.blocks_at=encoder.layer"]) == 2
    err = capsys.readouterr().err
    pipe = project / "pipe.py"
    assert err.startswith(
        f"raylane: pipeline '{pipe}': build(cfg) returned a Pipeline whose blocks = "
        f"'encoder.layer' names no module of the model (at {pipe}:"
    ), err
    assert len(err.splitlines()) == 1
    # Without --blocks nothing is built; where blocks matter to the run, check says how to see them.
    assert main(["check", str(project / "cfg.yaml"), "--set", "strategy.name=fsdp"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("# blocks: `raylane check --blocks` builds the model")
    assert main(["check", str(project / "cfg.yaml")]) == 0
    assert "# blocks" not in capsys.readouterr().out


@pytest.mark.untracked
def test_fsdp_shards_layers_not_at_model_blocks_per_layer_with_half_the_state(run_cli, project):
    """2 ranks: FSDP holds about half of DDP's state per rank, gathering each of the model's 2
    layers (at model.encoder.layers) on its own in forward and again in backward, besides the
    root (before: the whole model was one unit, one all-gather a step). A model with no repeated
    layers still trains under FSDP, as one unit, with a note saying so."""
    common = ["train", "cfg.yaml", "--set", "mlflow.log_model=false", "--set", "checkpoint.every_n_steps=0"]
    fsdp_counts = project / "fsdp-counts"
    runs = {
        "ddp": run_cli(
            "--nproc_per_node",
            "2",
            "-m",
            "raylane",
            *common,
            "--set",
            "strategy.name=ddp",
            "--set",
            "run.name=ddp",
            "--summary-json",
            "ddp.json",
            launcher=TORCHRUN,
            name="ddp",
        ),
        "fsdp": run_cli(
            "--nproc_per_node",
            "2",
            str(REPO / "tests/helpers/count_collectives.py"),
            str(fsdp_counts),
            "--",
            *common,
            "--set",
            "strategy.name=fsdp",
            "--set",
            "run.name=fsdp",
            "--summary-json",
            "fsdp.json",
            launcher=TORCHRUN,
            name="fsdp",
        ),
        "flat": run_cli(
            "--nproc_per_node",
            "2",
            "-m",
            "raylane",
            *common,
            "--set",
            "strategy.name=fsdp",
            "--set",
            "model.kind=flat",
            "--set",
            "run.name=flat",
            "--summary-json",
            "flat.json",
            launcher=TORCHRUN,
            name="flat",
        ),
    }
    for p in runs.values():
        assert p.wait(300) == 0, p.output
    ddp, fsdp, flat = (read_json(project / f"{name}.json") for name in runs)
    assert (ddp["strategy"], fsdp["strategy"], flat["strategy"]) == ("ddp", "fsdp", "fsdp")
    ratio = fsdp["memory"]["state_bytes_per_rank"] / ddp["memory"]["state_bytes_per_rank"]
    assert ratio <= 0.55, ratio
    steps = json.loads((project / "fsdp-counts.0.json").read_text())
    assert len(steps) == 4
    # The root once (kept gathered), each layer in forward and again in backward.
    assert {s["_allgather_base_"] for s in steps} == {1 + 2 * 2}, steps
    assert (
        "strategy fsdp (strategy.name: fsdp); blocks: 2 x Layer at encoder.layers (the largest repeated ModuleList)"
    ) in runs["fsdp"].output

    assert flat["status"] == "FINISHED"
    note = (
        "no repeated blocks found in Flat: FSDP shards the whole model as one unit (give the pipeline "
        "blocks=[...] or blocks='path.to.layers' to choose them; docs/pipelines.md, Blocks)"
    )
    assert runs["flat"].output.count(note) == 1, runs["flat"].output
