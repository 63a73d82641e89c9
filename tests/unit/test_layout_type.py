"""The one layout type (raylane.loop.distributed.layout.Layout, issue 61): built from the config
and the world, it names itself and gives its mesh as the Strategy, the summary and MLflow's tags
did before it; the checkpoint manifest records it and reads it back whole; a manifest written
before it (the dict `layout_of` wrote) still reads, says the same resume lines and restores the
random generators at its own layout. The old code's answers below were printed by that code
(raylane at c796f42) on the same layouts."""

from __future__ import annotations

import json

import pytest
import torch

from raylane.config import load_config
from raylane.loop import checkpoint
from raylane.loop.distributed.layout import Layout, LayoutError
from raylane.loop.distributed.parallelize import choose_strategy, model_parallel_strategy

pytestmark = pytest.mark.untracked

# What `layout_of` (raylane.loop.checkpoint.layout, before issue 61) wrote into the manifest.
OLD = {
    "single": {"strategy": "single", "name": "single", "tp": 1, "pp": 1, "dp": 1, "world_size": 1},
    "ddp2": {"strategy": "ddp", "name": "ddp", "tp": 1, "pp": 1, "dp": 2, "world_size": 2},
    "fsdp4": {"strategy": "fsdp", "name": "fsdp", "tp": 1, "pp": 1, "dp": 4, "world_size": 4},
    "hsdp8": {"strategy": "hsdp", "name": "hsdp", "tp": 1, "pp": 1, "dp": 8, "world_size": 8},
    "tp2": {"strategy": "tp2", "name": "fsdp", "tp": 2, "pp": 1, "dp": 1, "world_size": 2},
    "fsdp_tp2": {"strategy": "fsdp×tp2", "name": "fsdp", "tp": 2, "pp": 1, "dp": 2, "world_size": 4},
    "tp2_sp_lp": {"strategy": "tp2+sp+lp", "name": "fsdp", "tp": 2, "pp": 1, "dp": 1, "world_size": 2},
    "pp2": {"strategy": "pp2", "name": "fsdp", "tp": 1, "pp": 2, "dp": 1, "world_size": 2},
    "fsdp_pp2": {"strategy": "fsdp×pp2", "name": "fsdp", "tp": 1, "pp": 2, "dp": 2, "world_size": 4},
    "hsdp_tp2_pp2": {"strategy": "hsdp×tp2×pp2", "name": "fsdp", "tp": 2, "pp": 2, "dp": 4, "world_size": 16},
}
UNTIED = "model.tie_embeddings=false"
# name -> (--set overrides, ranks) of the model-parallel layouts above
MODEL_PARALLEL = {
    "tp2": (["strategy.tp=2"], 2),
    "fsdp_tp2": (["strategy.name=fsdp", "strategy.tp=2"], 4),
    "tp2_sp_lp": (["strategy.tp=2", "strategy.sequence_parallel=true", "strategy.loss_parallel=true"], 2),
    "pp2": (["strategy.pp=2", UNTIED], 2),
    "fsdp_pp2": (["strategy.name=fsdp", "strategy.pp=2", UNTIED], 4),
    "hsdp_tp2_pp2": (["strategy.name=fsdp", "strategy.pp=2", "strategy.tp=2", "strategy.dp_replicate=2", UNTIED], 16),
}


def layouts() -> dict[str, Layout]:
    """Each layout of OLD as the run builds it now."""
    hsdp = load_config("gpt-tiny", ["strategy.name=fsdp", "strategy.dp_replicate=2"])
    built = {
        "single": Layout("single"),
        "ddp2": Layout.data_parallel_of("ddp", 2),
        "fsdp4": Layout.data_parallel_of("fsdp", 4),
        "hsdp8": choose_strategy(hsdp, torch.device("cpu"), 8, torch.nn.Linear(1, 1), None, None).layout,
    }
    for name, (sets, ranks) in MODEL_PARALLEL.items():
        built[name] = model_parallel_strategy(load_config("gpt-tiny", sets), ranks).layout
    return built


def test_the_layouts_built_now_record_what_the_old_code_recorded_and_come_back_whole(tmp_path):
    """Every key of the old record, with the old value (but the flavour of FSDP2 with replicas
    under model parallelism: `hsdp`, as its label always said, where the Strategy's name was
    `fsdp`); and the record through JSON, and through a real checkpoint's manifest, is the same
    Layout again."""
    for name, layout in layouts().items():
        record = layout.record()
        expected = {**OLD[name], "name": "hsdp"} if name == "hsdp_tp2_pp2" else OLD[name]
        assert {k: record[k] for k in expected} == expected, name
        assert Layout.from_record(json.loads(json.dumps(record))) == layout, name

    mesh_check = model_parallel_strategy(load_config("gpt-tiny"), 1, tp=1).layout  # scripts/gpu_mesh_check.py's
    assert mesh_check.mesh_shape == (1, 1, 1, 1, 1) and Layout.from_record(mesh_check.record()) == mesh_check

    model = torch.nn.Linear(2, 2)
    path = tmp_path / checkpoint.checkpoint_name(1)
    path.mkdir()
    saved = layouts()["hsdp_tp2_pp2"]
    checkpoint.save(path, model, torch.optim.SGD(model.parameters()), {"step": 1, "layout": saved.record()}, rank=0)
    assert Layout.from_record(checkpoint.read_manifest(path)["train_state"]["layout"]) == saved


def test_a_record_from_before_reads_back_and_says_the_old_lines():
    """The old dicts read back with their label, sizes and flags (the split of HSDP's ranks they
    never held: as shards); each is the same layout as the one built now for it (random
    generators restored), and a resume at another says the line the old code said."""
    built = layouts()
    for name, old in OLD.items():
        was = Layout.from_record(old)
        assert (was.label(), was.world_size, was.data_parallel, was.tp, was.pp) == (
            old["strategy"],
            old["world_size"],
            old["dp"],
            old["tp"],
            old["pp"],
        ), name
        assert built[name].same_as(old) and built[name].resumed_from({"layout": old}) is None, name
        assert not any(built[other].same_as(old) for other in built if other != name), name
    assert Layout.from_record(OLD["tp2_sp_lp"]).sequence_parallel and Layout.from_record(OLD["tp2_sp_lp"]).loss_parallel
    assert Layout.from_record(OLD["hsdp_tp2_pp2"]).name == "hsdp"
    # The old code's lines for these moves (change_line on the old records):
    said = {
        ("fsdp_tp2", "ddp2"): "resuming a fsdp×tp2 checkpoint of 4 ranks as ddp on 2",
        ("tp2", "single"): "resuming a tp2 checkpoint of 2 ranks as one process",
        ("single", "tp2"): "resuming a one-process checkpoint of 1 rank as tp2 on 2",
        ("hsdp_tp2_pp2", "hsdp8"): "resuming a hsdp×tp2×pp2 checkpoint of 16 ranks as hsdp on 8",
        ("pp2", "fsdp_tp2"): "resuming a pp2 checkpoint of 2 ranks as fsdp×tp2 on 4",
        ("tp2_sp_lp", "tp2"): "resuming a tp2+sp+lp checkpoint of 2 ranks as tp2 on 2",
    }
    for (source, target), line in said.items():
        assert built[target].resumed_from({"layout": OLD[source]}) == line
    # A checkpoint from before the layout record: its world size alone.
    assert built["single"].resumed_from({"world_size": 2}) == "resuming a checkpoint of 2 ranks as one process"
    assert built["ddp2"].resumed_from({"world_size": 2}) is None
    assert built["ddp2"].same_as(None) and built["ddp2"].resumed_from({"layout": "torn", "world_size": 2}) is None


def test_the_layout_names_itself_and_gives_its_mesh_as_the_strategy_did():
    """The summary's `mesh` and MLflow's strategy tags, as the old Strategy gave them."""
    built = layouts()
    meshes = {
        "single": (),
        "ddp2": (2,),
        "fsdp4": (4,),
        "hsdp8": (2, 4),
        "tp2": (1, 1, 1, 1, 2),
        "fsdp_tp2": (1, 1, 2, 1, 2),
        "pp2": (2, 1, 1, 1, 1),
        "fsdp_pp2": (2, 1, 2, 1, 1),
        "hsdp_tp2_pp2": (2, 2, 2, 1, 2),
    }
    assert {name: built[name].mesh_shape for name in meshes} == meshes
    texts = {
        "tp2": "dp_shard 1, tp 2",
        "pp2": "pp 2, dp_shard 1, tp 1",
        "hsdp_tp2_pp2": "pp 2, dp_replicate 2, dp_shard 2, tp 2",
    }
    assert {name: built[name].mesh_text() for name in texts} == texts
    assert built["fsdp4"].mesh_text() == "" and built["hsdp8"].described() == "hsdp on 8"
    strategy = model_parallel_strategy(load_config("gpt-tiny", MODEL_PARALLEL["fsdp_pp2"][0]), 4)
    assert strategy.tags() == {
        "raylane.strategy": "fsdp×pp2",
        "raylane.strategy.reason": "strategy.pp: 2 (1F1B, 2 micro-batches, 2 stages), FSDP2 over 2 data-parallel ranks",
        "raylane.strategy.mesh": "pp 2, dp_shard 2, tp 1",
        "raylane.strategy.pp_schedule": "1F1B",
    }
    # (pp 2, dp 2, tp 2): the ranks of a tensor-parallel pair, and a pipeline's stages, read one share
    assert [built["hsdp_tp2_pp2"].data_rank(r) for r in range(16)] == [0, 0, 1, 1, 2, 2, 3, 3] * 2


def test_sizes_the_world_does_not_divide_are_one_line_naming_the_fields():
    s = load_config("gpt-tiny", ["strategy.name=fsdp", "strategy.tp=2"]).strategy
    with pytest.raises(LayoutError, match=r"^strategy.tp = 2: does not divide the 3 ranks \(a tensor-parallel"):
        Layout.model_parallel_of(s, 3)
    s = load_config("gpt-tiny", ["strategy.name=fsdp", "strategy.pp=2", "strategy.tp=2", UNTIED]).strategy
    with pytest.raises(LayoutError, match=r"^strategy.pp = 2 x strategy.tp = 2: 4 ranks do not divide 6 workers$"):
        Layout.model_parallel_of(s, 6, world="6 workers")
    with pytest.raises(LayoutError, match=r"^strategy.dp_replicate = 2: 2 ranks do not divide the 1 ranks$"):
        Layout.data_parallel_of("fsdp", 1, replicas=2)


def test_an_old_manifest_restores_the_random_generators_at_its_own_layout_only(tmp_path):
    """A checkpoint whose manifest holds the old record: loaded at that layout, its random
    generators come back (the next draw is the one after the save); at another layout of as many
    ranks they are not (rank r there is another part of the model and the data)."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loads = {}
    for name, record in {"same": OLD["single"], "other": {**OLD["fsdp4"], "dp": 1, "world_size": 1}}.items():
        path = tmp_path / name
        path.mkdir()
        torch.manual_seed(7)
        checkpoint.save(path, model, optimizer, {"step": 1, "world_size": 1, "layout": record}, rank=0)
        after_save = torch.rand(3)
        torch.manual_seed(99)
        state = checkpoint.load(path, model, optimizer, rank=0, layout=Layout("single"))
        loads[name] = (torch.equal(torch.rand(3), after_save), Layout("single").resumed_from(state))
    assert loads == {
        "same": (True, None),
        "other": (False, "resuming a one-process checkpoint of 1 rank as one process"),
    }
