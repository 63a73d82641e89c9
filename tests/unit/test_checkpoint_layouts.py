"""Checkpoints that move between layouts (issue 49), in-process or on two gloo processes: the
optimizer's state written flat, by parameter name, so that the hyperparameters of ranks holding
different parameters (pipeline stages) survive a save and a load at any layout (trap e); the
layout recorded in the manifest and the line a resume at another layout says; a layout whose
data-parallel ranks do not split the held global batch refused before launch; an export that
builds its model as one process whatever the layout."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from raylane.config import ConfigError, load_config
from raylane.loop import checkpoint
from raylane.loop.checkpoint.state import flat_optim, nested_optim, regrouped, scheduler_state_for
from raylane.loop.distributed.layout import Layout
from tests.conftest import REPO

pytestmark = pytest.mark.untracked

BETAS = (0.8, 0.95)


def _two_groups(model: torch.nn.Module, lrs=(0.03, 0.01)) -> torch.optim.Optimizer:
    first, second = list(model.children())
    return torch.optim.AdamW(
        [
            {"params": list(first.parameters()), "lr": lrs[0], "weight_decay": 0.1},
            {"params": list(second.parameters()), "lr": lrs[1], "weight_decay": 0.0},
        ],
        betas=BETAS,
    )


def _stepped(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 3)).sum().backward()
    optimizer.step()


def test_the_flat_optimizer_state_keys_every_value_by_parameter_name_and_comes_back_grouped():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = _two_groups(model)
    _stepped(model, optimizer)
    nested = checkpoint.live_state(model, optimizer)["optim"]
    flat = flat_optim(nested)
    assert flat["param_groups.1.weight.lr"] == 0.01 and flat["param_groups.0.bias.betas"] == BETAS
    assert flat["state.0.weight.exp_avg"] is nested["state"]["0.weight"]["exp_avg"]  # references, not copies
    assert "params" in nested["param_groups"][0]  # the nested state is left as it was

    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    template = checkpoint.live_state(fresh, _two_groups(fresh, lrs=(1.0, 1.0)))["optim"]
    back = nested_optim(flat, template)
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in back["param_groups"]] == [
        (0.03, BETAS, 0.1),
        (0.01, BETAS, 0.0),
    ]
    assert back["state"]["1.bias"]["exp_avg_sq"] is nested["state"]["1.bias"]["exp_avg_sq"]
    assert regrouped(flat, template, {}) is None  # other learning rates, the same grouping
    readable = checkpoint.state.grouped(flat)  # for a reader without the model
    assert [(g["lr"], g["params"]) for g in readable["param_groups"]] == [
        (0.03, ["0.weight", "0.bias"]),
        (0.01, ["1.weight", "1.bias"]),
    ]
    assert readable["state"]["1.weight"]["exp_avg"] is nested["state"]["1.weight"]["exp_avg"]

    one = torch.optim.AdamW(fresh.parameters())  # one group where the checkpoint had two
    assert regrouped(flat, checkpoint.live_state(fresh, one)["optim"], {}) == (2, 1)
    with pytest.raises(KeyError, match="state.0.weight.momentum_buffer"):
        sgd = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        nested_optim(flat, checkpoint.live_state(fresh, sgd)["optim"])


def test_a_replicated_checkpoint_is_written_flat_and_a_regrouped_optimizer_is_refused(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = _two_groups(model)
    _stepped(model, optimizer)
    path = tmp_path / checkpoint.checkpoint_name(1)
    path.mkdir()
    checkpoint.save(path, model, optimizer, {"step": 1}, rank=0)
    assert checkpoint.read_manifest(path)["optim_state"] == "flat"
    saved = torch.load(path / checkpoint.STATE_FILE, weights_only=True)["optim"]
    assert saved["param_groups.1.bias.lr"] == 0.01 and "param_groups" not in saved

    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    again = _two_groups(fresh, lrs=(1.0, 1.0))
    checkpoint.load(path, fresh, again)
    assert [(g["lr"], g["betas"]) for g in again.param_groups] == [(0.03, BETAS), (0.01, BETAS)]
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(optimizer.state[p]["exp_avg"], again.state[q]["exp_avg"])
    with pytest.raises(checkpoint.CheckpointLoadError, match=r"2 parameter groups there, 1 here"):
        checkpoint.load(path, fresh, torch.optim.AdamW(fresh.parameters()))


def test_the_layout_is_recorded_and_a_resume_at_another_says_so_in_one_line():
    fsdp_tp = Layout("fsdp", dp_shard=2, tp=2)  # (pp, dp_replicate, dp_shard, cp, tp) = (1, 1, 2, 1, 2)
    record = fsdp_tp.record()
    kept = {k: record[k] for k in ("strategy", "name", "tp", "pp", "dp", "world_size")}
    assert kept == {"strategy": "fsdp×tp2", "name": "fsdp", "tp": 2, "pp": 1, "dp": 2, "world_size": 4}
    tp, one, ddp = Layout("fsdp", tp=2), Layout("single"), Layout.data_parallel_of("ddp", 2)
    assert ddp.resumed_from({"layout": record}) == "resuming a fsdp×tp2 checkpoint of 4 ranks as ddp on 2"
    assert one.resumed_from({"layout": tp.record()}) == "resuming a tp2 checkpoint of 2 ranks as one process"
    assert tp.resumed_from({"layout": one.record()}) == "resuming a one-process checkpoint of 1 rank as tp2 on 2"
    assert ddp.resumed_from({"layout": dict(ddp.record())}) is None
    # A checkpoint from before the record: its world size alone.
    assert one.resumed_from({"world_size": 2}) == "resuming a checkpoint of 2 ranks as one process"
    assert ddp.resumed_from({"world_size": 2}) is None


def test_a_layout_with_experts_split_records_ep_and_an_older_record_reads_as_ep_1():
    import dataclasses

    fsdp_ep = dataclasses.replace(Layout.data_parallel_of("fsdp", 2), ep=2)
    assert (fsdp_ep.label(), Layout.from_record(fsdp_ep.record())) == ("fsdp×ep2", fsdp_ep)
    fsdp = Layout.data_parallel_of("fsdp", 2)
    assert fsdp.resumed_from({"layout": fsdp_ep.record()}) == "resuming a fsdp×ep2 checkpoint of 2 ranks as fsdp on 2"
    older = {k: v for k, v in fsdp.record().items() if k != "ep"}  # written before ep was a field
    assert Layout.from_record(older) == fsdp and fsdp.resumed_from({"layout": older}) is None


def test_the_driver_says_the_move_once_after_the_strategy_line():
    """A restarted group (elastic, a failure) sends its start again: the move was said once."""
    import io

    from raylane.loop.protocols.events import Start
    from raylane.tracking.progress import ProgressDisplay

    out = io.StringIO()
    display = ProgressDisplay(stream=out, live=False)
    said = "resuming a tp2 checkpoint of 2 ranks as fsdp on 4"
    for _ in range(2):
        start = Start(total_steps=10, steps_per_epoch=10, max_epochs=1, world_size=4, host="h", strategy="fsdp")
        display.handle(dataclasses.replace(start, resumed_from_step=3, resumed_layout=said))
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["[raylane] strategy fsdp ()", f"[raylane] {said}", "[raylane] resumed from step 3"]
    assert lines.count(f"[raylane] {said}") == 1, lines


def test_a_layout_whose_data_parallel_ranks_do_not_split_the_held_global_batch_exits_before_launch(monkeypatch):
    """fsdp×tp2 on 6 ranks has 3 data-parallel ranks: 32 samples a step do not split."""
    from raylane.api import prepare_train

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "6")
    sets = ["train.global_batch=32", "strategy.name=fsdp", "strategy.tp=2", "mlflow.enabled=false"]
    with pytest.raises(ConfigError) as err:
        prepare_train("gpt-tiny", sets)
    assert str(err.value) == (
        "train.global_batch = 32: not a multiple of train.batch_size = 16 x 3 data-parallel ranks "
        "(6 ranks in model-parallel groups of 2), so train.grad_accum_steps cannot hold it"
    )


def test_export_builds_the_model_as_one_process_whatever_layout_trained_it():
    from raylane.config import validate
    from raylane.export import one_process

    saved = load_config("gpt-tiny", ["strategy.tp=2", "strategy.sequence_parallel=true"]).model_dump(mode="json")
    cfg = validate(one_process(saved))
    assert (cfg.strategy.tp, cfg.strategy.sequence_parallel, cfg.model.n_head) == (1, False, 2)


STAGES = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from raylane.loop import checkpoint
    from raylane.loop.checkpoint.state import mark_partial

    rank, path, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)

    def stage(r, lr):
        # A pipeline stage: its own block under the whole model's name (blocks.0 or blocks.1),
        # its own optimizer, whose one group is group 0 on both ranks.
        torch.manual_seed(r)
        model = torch.nn.Module()
        model.blocks = torch.nn.ModuleDict({str(r): torch.nn.Linear(3, 3)})
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.8, 0.95), weight_decay=0.1 * (r + 1))
        return mark_partial(model), opt

    model, opt = stage(rank, lr=0.03 if rank == 0 else 0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    model.blocks[str(rank)](torch.randn(4, 3)).sum().backward()
    opt.step()
    schedule.step()
    train_state = {"step": 1, "world_size": 2, "scheduler": schedule.state_dict()}
    checkpoint.save(path, model, opt, train_state, rank=rank)
    torch.save({"model": dict(model.state_dict()), "optim": opt.state_dict()}, f"{out}/saved_{rank}.pt")

    fresh, again = stage(rank, lr=1.0)  # the same layout, resumed
    resumed = torch.optim.lr_scheduler.LambdaLR(again, lambda step: 0.5 ** step)
    resumed.load_state_dict(checkpoint.load(path, fresh, again, rank=rank)["scheduler"])
    group = {k: v for k, v in again.param_groups[0].items() if k != "params"}
    assert group["initial_lr"] == (0.03 if rank == 0 else 0.01) and resumed.last_epoch == 1
    fresh.blocks[str(rank)](torch.randn(4, 3)).sum().backward()
    again.step()  # KeyError: 'betas' where the group lost its hyperparameters
    print(json.dumps({"lr": group["lr"], "betas": list(group["betas"]), "wd": group["weight_decay"]}), flush=True)
    dist.destroy_process_group()
    os._exit(0)
""")


def test_pipeline_stages_keep_their_hyperparameters_at_the_same_and_at_another_layout(tmp_path):
    """Trap e: two ranks, each a stage holding its own parameters under the whole model's names,
    each optimizer's one group its group 0. Keyed by group index (torch's default), the groups
    collide in the checkpoint (DCP keeps rank 0's): rank 1 comes back without its lr, betas and
    weight decay, or with rank 0's. Flat, each rank's come back, and the whole model in one
    process gets both stages' hyperparameters, tensors bit-exact."""
    path = tmp_path / checkpoint.checkpoint_name(1)
    path.mkdir()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STAGES, str(rank), str(path), init, str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    resumed = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert resumed == [  # half the initial lr after the schedule's first step
        {"lr": 0.015, "betas": [0.8, 0.95], "wd": 0.1},
        {"lr": 0.005, "betas": [0.8, 0.95], "wd": 0.2},
    ]
    manifest = checkpoint.read_manifest(path)
    assert sorted(manifest["shapes"]) == ["blocks.0.bias", "blocks.0.weight", "blocks.1.bias", "blocks.1.weight"]

    # The whole model in one process, an optimizer group per stage as its config would build it.
    whole = torch.nn.Module()
    whole.blocks = torch.nn.ModuleDict({"0": torch.nn.Linear(3, 3), "1": torch.nn.Linear(3, 3)})
    optimizer = torch.optim.AdamW(
        [{"params": list(whole.blocks[str(r)].parameters()), "weight_decay": 0.1 * (r + 1)} for r in (0, 1)]
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    # Rank 0's schedule (one group) fitted to the whole model's two groups, their lrs from the optimizer.
    schedule.load_state_dict(scheduler_state_for(checkpoint.load(path, whole, optimizer)["scheduler"], optimizer))
    assert [(g["lr"], g["initial_lr"], g["betas"], g["weight_decay"]) for g in optimizer.param_groups] == [
        (0.015, 0.03, (0.8, 0.95), 0.1),
        (0.005, 0.01, (0.8, 0.95), 0.2),
    ]

    for rank in (0, 1):
        saved = torch.load(tmp_path / f"saved_{rank}.pt", weights_only=True)
        params = list(whole.blocks[str(rank)].parameters())
        for name, p in zip(("weight", "bias"), params, strict=True):
            assert torch.equal(p, saved["model"][f"blocks.{rank}.{name}"])
        for i, p in enumerate(params):
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(optimizer.state[p][key], saved["optim"]["state"][i][key])
    optimizer.step()
    schedule.step()
    assert [g["lr"] for g in optimizer.param_groups] == [0.0075, 0.0025]  # the schedule goes on from step 1


def test_a_sharded_checkpoint_in_the_nested_format_still_loads(tmp_path):
    """Sharded checkpoints from before the flat form hold the optimizer's groups by index."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = _two_groups(model)
    _stepped(model, optimizer)
    path = tmp_path / checkpoint.checkpoint_name(2)
    path.mkdir()
    checkpoint.state.dcp().save(checkpoint.live_state(model, optimizer), checkpoint_id=str(path), no_dist=True)
    checkpoint.PendingSave(Path(path), 0, {"step": 2}).commit()
    assert "optim_state" not in checkpoint.read_manifest(path)

    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    again = _two_groups(fresh, lrs=(1.0, 1.0))
    checkpoint.load(path, fresh, again)
    assert [g["lr"] for g in again.param_groups] == [0.03, 0.01]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters(), strict=True))
