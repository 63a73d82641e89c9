"""Evaluation every N steps, named held-out sets, early stopping and hooks (issue 37), with the
pipeline of tests/helpers/ema_pipeline.py (a linear regression; 48 training rows, so 6 steps an
epoch at batch 8 in one process, 3 on 2 ranks): in one process, and under torchrun on 2 DDP
ranks. MLflow's metrics are read from its sqlite database."""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

from raylane.config import ConfigError, load_config
from raylane.loop import checkpoint
from raylane.prechecks import check_run
from tests.conftest import REPO, TORCHRUN, read_json

HELPER = REPO / "tests" / "helpers" / "ema_pipeline.py"
CONFIG = """pipeline: ./pipe.py
train: {batch_size: 8, max_epochs: 2}
optim: {lr: 0.05}
mlflow: {log_every_n_steps: 5, log_model: false}
"""


@pytest.fixture
def project(tmp_path) -> Path:
    shutil.copy(HELPER, tmp_path / "pipe.py")
    (tmp_path / "cfg.yaml").write_text(CONFIG)
    return tmp_path


def _train(run_cli, name: str, *sets: str, ranks: int = 1, code: int = 0):
    args = ["train", "cfg.yaml", "--set", f"run.name={name}", "--summary-json", f"{name}.json"]
    for value in sets:
        args += ["--set", value]
    if ranks == 1:
        proc = run_cli(*args, "--local", name=name)
    else:
        proc = run_cli("--nproc_per_node", str(ranks), "-m", "raylane", *args, launcher=TORCHRUN, name=name)
    assert proc.wait(180) == code, proc.output
    return proc


def _history(project: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    with sqlite3.connect(project / "mlflow.db") as con:
        rows = con.execute(
            "SELECT step, value FROM metrics WHERE run_uuid = ? AND key = ? ORDER BY step", (run_id, key)
        ).fetchall()
    return [(step, value) for step, value in rows]


def _tag(project: Path, run_id: str, key: str) -> str | None:
    with sqlite3.connect(project / "mlflow.db") as con:
        row = con.execute("SELECT value FROM tags WHERE run_uuid = ? AND key = ?", (run_id, key)).fetchone()
    return row[0] if row else None


def test_evaluation_every_n_steps_of_two_named_sets_reaches_mlflow_checkpoints_and_hooks(run_cli, project):
    """12 steps (2 epochs of 6), evaluated every 4 steps and at epoch ends: at steps 4, 6, 8
    and 12, once each (12 is both), each named set under its own prefix in MLflow and in the
    summary; the checkpoints due at steps 4 and 8 (mid-epoch) carry the metrics; the hooks are
    called at every step end (train metrics at the logged steps), every evaluation end and
    every committed checkpoint, and the EMA hook's evaluation is logged as ema/<set>/loss."""
    proc = _train(
        run_cli,
        "every",
        "model.named_sets=true",
        "model.hooks=[record,ema]",
        "train.eval_every_n_steps=4",
        "checkpoint.every_n_steps=4",
        "checkpoint.keep=null",
    )
    summary = read_json(project / "every.json")
    assert summary["status"] == "FINISHED" and summary["steps"] == 12
    assert set(summary["metrics"]) == {"val/loss", "test/loss"}
    run = summary["run_id"]
    for key in ("eval/val/loss", "eval/test/loss", "ema/val/loss", "ema/test/loss"):
        assert [step for step, _ in _history(project, run, key)] == [4, 6, 8, 12], key
    assert dict(_history(project, run, "eval/val/loss"))[12] == summary["metrics"]["val/loss"]
    assert re.search(r"\[raylane\] step 4 eval: test/loss [\d.]+ val/loss [\d.]+", proc.output)
    folder = Path(summary["checkpoint"]).parent
    for step in (4, 8):
        carried = checkpoint.read_manifest(folder / checkpoint.checkpoint_name(step))["train_state"]["eval_metrics"]
        assert carried == {k: v for k, v in dict(_history_at(project, run, step)).items()}, step

    calls = json.loads((project / "calls-0.json").read_text())
    assert calls["setup"] == [0]
    assert [step for step, _ in calls["step_end"]] == list(range(1, 13))
    assert {step: keys for step, keys in calls["step_end"] if keys} == {
        5: ["grad_norm", "loss", "lr", "samples_per_s"],
        10: ["grad_norm", "loss", "lr", "samples_per_s"],
    }
    assert [(step, metrics) for step, metrics in calls["eval_end"]] == [
        (step, dict(_history_at(project, run, step))) for step in (4, 6, 8, 12)
    ]
    assert calls["checkpoint"] == [[step, str(folder / checkpoint.checkpoint_name(step))] for step in (4, 6, 8, 12)]


def _history_at(project: Path, run_id: str, step: int) -> list[tuple[str, float]]:
    """The eval metrics MLflow has at `step`, by their names in the summary (val/loss)."""
    out = []
    for key in ("val/loss", "test/loss"):
        values = [v for s, v in _history(project, run_id, f"eval/{key}") if s == step]
        assert len(values) == 1, (key, step, values)
        out.append((key, values[0]))
    return out


def test_early_stopping_ends_the_run_finished_with_its_reason_and_a_relaunch_trains_no_further(run_cli, project):
    """A learning rate too small to move the held-out loss by min_delta: evaluated every 2
    steps, the best is the first evaluation's (step 2), and two more without improvement stop
    the run at step 6, with a checkpoint there, FINISHED; the reason is in the summary, on the
    terminal and in MLflow's tag. A relaunch with more epochs trains nothing (the run finished),
    even with the run's record gone (the checkpoint's early-stopping state says so)."""
    stop = [
        "optim.lr=1e-9",
        "train.max_epochs=20",
        "train.eval_every_n_steps=2",
        "train.eval_every_n_epochs=0",
        "model.named_sets=true",
        "train.early_stopping={metric: val/loss, patience: 2, min_delta: 0.01}",
    ]
    proc = _train(run_cli, "early", *stop)
    summary = read_json(project / "early.json")
    assert summary["status"] == "FINISHED" and summary["steps"] == 6 and summary["early_stopped"]
    best = _history(project, summary["run_id"], "eval/val/loss")
    assert [step for step, _ in best] == [2, 4, 6]
    reason = (
        f"early stopping: val/loss did not decrease by more than 0.01 for 2 evaluations "
        f"(best {best[0][1]:.4g} at step 2)"
    )
    assert summary["stop_reason"] == reason
    assert f"  stopped:       {reason}\n" in proc.output
    assert _tag(project, summary["run_id"], "raylane.stop_reason") == reason
    assert summary["checkpoint"].endswith(checkpoint.checkpoint_name(6))
    state = checkpoint.read_manifest(summary["checkpoint"])["train_state"]["early_stopping"]
    assert state["reason"] == reason and state["best_step"] == 2

    again = _train(run_cli, "early", *stop, "train.max_epochs=30")
    assert f"run early: already FINISHED at step 6 (epoch 1; {reason})" in again.output
    (project / "runs" / "early" / "raylane_run.json").unlink()  # as on object storage, where it is not read
    _train(run_cli, "early", *stop, "train.max_epochs=30", "mlflow.enabled=false")
    resumed = read_json(project / "early.json")
    assert resumed["steps"] == 6 and resumed["resumed_from_step"] == 6 and resumed["stop_reason"] == reason
    assert max(p.name for p in (project / "runs" / "early").glob("checkpoint_*")) == checkpoint.checkpoint_name(6)

    # Another run started from that checkpoint (PBT's donor, a fine-tune) is not stopped by it.
    _train(
        run_cli,
        "child",
        *stop[:-1],
        "train.max_epochs=2",
        "mlflow.enabled=false",
        f"checkpoint.init_from={summary['checkpoint']}",
    )
    child = read_json(project / "child.json")
    assert child["resumed_from_step"] == 6 and child["steps"] == 12 and not child["early_stopped"], child


@pytest.mark.untracked
def test_a_hook_that_raises_fails_the_run_naming_it_and_its_line(run_cli, project):
    proc = _train(run_cli, "boom", "model.hooks=[boom]", code=1)
    line = next(
        n for n, text in enumerate((project / "pipe.py").read_text().splitlines(), 1) if "raise ValueError" in text
    )
    assert (
        f"error:         pipeline '{project / 'pipe.py'}': hook Boom.on_step_end raised ValueError: the hook "
        f"broke at step 2 (at {project / 'pipe.py'}:{line})"
    ) in proc.output
    assert "Traceback" not in proc.output


def _whole(location: str, tmp: Path) -> dict:
    """A checkpoint's state in one dict: its state.pt, or a sharded one's DCP files gathered."""
    if (Path(location) / checkpoint.STATE_FILE).exists():
        return torch.load(Path(location) / checkpoint.STATE_FILE, weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(location, tmp)
    return torch.load(tmp, weights_only=False)  # written just now from this run's checkpoint


# Slow (~19 s a strategy): make test saves and restores a hook's state at a mid-epoch resume in one
# process (tests/unit/test_trainer.py: test_a_hooks_state_is_saved_with_each_checkpoint_...), hands
# a replicated checkpoint's hook state to FSDP ranks (below), and calls hooks on 2 ranks (above).
@pytest.mark.untracked
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_ema_hook_resumes_from_its_state_in_the_checkpoint(run_cli, project, strategy):
    """2 DDP (or FSDP) ranks, 7 steps straight, checkpoints every 4 steps; a run resumed from the
    straight run's checkpoint at step 4 (mid-epoch) ends at step 7 with the same weights and the
    same averaged weights, bit for bit: the hook's state was saved and loaded (under FSDP, each
    rank's shard of it). Both ranks' hooks were called at the same steps with the same held-out
    metrics (rank 1 gets no train metrics)."""
    common = [
        "model.hooks=[ema,record]",
        "train.max_steps=7",
        "train.max_epochs=3",
        "checkpoint.every_n_steps=4",
        f"strategy.name={strategy}",
    ]
    _train(run_cli, "straight", *common, ranks=2)
    straight = read_json(project / "straight.json")
    resumed_dir = project / "runs" / "resumed"
    resumed_dir.mkdir(parents=True)
    shutil.copytree(
        Path(straight["checkpoint"]).parent / checkpoint.checkpoint_name(4), resumed_dir / checkpoint.checkpoint_name(4)
    )
    zero, one = (json.loads((project / f"calls-{rank}.json").read_text()) for rank in (0, 1))
    assert [s for s, _ in zero["step_end"]] == [s for s, _ in one["step_end"]] == list(range(1, 8))
    assert not any(keys for _, keys in one["step_end"]) and zero["eval_end"] == one["eval_end"]
    assert [s for s, _ in zero["checkpoint"]] == [s for s, _ in one["checkpoint"]] == [3, 4, 6, 7]
    assert zero["world_size"] == 2

    _train(run_cli, "resumed", *common, ranks=2)
    resumed = read_json(project / "resumed.json")
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 7
    a, b = (_whole(r["checkpoint"], project / f"{i}.pt") for i, r in enumerate((straight, resumed)))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    shadow = a["hooks"]["0.EMA"]["shadow"]
    assert set(shadow) == {"weight", "bias"} and not torch.equal(shadow["weight"], a["model"]["weight"])
    for name, tensor in shadow.items():
        assert torch.equal(tensor, b["hooks"]["0.EMA"]["shadow"][name]), name


def test_an_early_stopping_metric_the_pipeline_does_not_report_is_refused_before_the_run(project, monkeypatch):
    monkeypatch.chdir(project)
    cfg = load_config("cfg.yaml", ["model.named_sets=true", "train.early_stopping.metric=val/los"])
    with pytest.raises(ConfigError) as err:
        check_run(cfg)
    assert str(err.value) == (
        "train.early_stopping.metric = 'val/los': not a metric the pipe pipeline reports "
        "(did you mean val/loss?); it reports: val/loss, test/loss"
    )


def test_early_stopping_with_no_evaluation_to_count_is_refused_before_the_run(project, monkeypatch):
    monkeypatch.chdir(project)
    with pytest.raises(ConfigError) as err:
        load_config("cfg.yaml", ["train.early_stopping.metric=loss", "train.eval_every_n_epochs=0"])
    assert str(err.value).endswith(
        "train.early_stopping.metric = 'loss': early stopping counts evaluations, and "
        "train.eval_every_n_epochs and train.eval_every_n_steps are both 0 (the run would "
        "never stop early); set one of them"
    )


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_a_replicated_checkpoint_gives_an_fsdp_run_its_hooks_state_sharded(tmp_path, monkeypatch, optimizer_class):
    """The EMA hook's averages saved by a DDP (or one-process) run, resumed under FSDP: each rank
    gets its shard (before: a plain tensor copied into the hook's DTensor, a RuntimeError). With
    SGD, whose optimizer has no state, too (before: torch's full-state-dict load failed on it:
    'Expected device to be set')."""
    import importlib.util
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    spec = importlib.util.spec_from_file_location("ema_helper", HELPER)
    ema = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ema)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(__import__("tests.conftest", fromlist=["free_port"]).free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:

        def make(shard: bool):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
            if shard:
                fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
            optimizer = optimizer_class(model.parameters(), lr=0.1)
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            hook = ema.EMA()
            hook.setup(SimpleNamespace(model=model))
            return model, optimizer, hook

        model, optimizer, hook = make(False)
        path = tmp_path / checkpoint.checkpoint_name(1)
        path.mkdir()
        state = {**checkpoint.live_state(model, optimizer), "hooks": {"0.EMA": hook.state_dict()}}
        checkpoint.write(
            str(path),
            state,
            {"step": 1, "hooks": ["0.EMA"], "world_size": 1, "epoch": 0},
            rank=0,
            rng=checkpoint.rng_state(),
            replicated=True,
        ).commit()
        sharded, optimizer2, hook2 = make(True)
        loaded = checkpoint.load(str(path), sharded, optimizer2, rank=0, hooks={"0.EMA": hook2.state_dict()})
        hook2.load_state_dict(loaded["hook_states"]["0.EMA"])
        for name, value in hook.state_dict()["shadow"].items():
            assert torch.equal(hook2.state_dict()["shadow"][name].full_tensor(), value)
    finally:
        dist.destroy_process_group()


def test_the_docs_quote_the_tested_ema_hook_verbatim():
    source = HELPER.read_text()
    example = source.split("# -- the docs' example: begin")[1].split("\n", 1)[1].split("# -- the docs' example: end")[0]
    docs = (REPO / "docs" / "pipelines.md").read_text()
    assert example.strip() in docs


STREAMING = """
import os
import raylane


class DataSection(raylane.Section):
    root: str


class Config(raylane.BaseConfig):
    data: DataSection

    def eval_metrics(self):
        return ("val/row", "test/row")


def _source(cfg, name):
    def transform(batch):
        # Where the files are read: a Ray Data task, or a rank's own reader (pyarrow).
        who = "task" if "RAY_RAYLET_PID" in os.environ else os.environ.get("RANK", "0")
        open(os.path.join(cfg.data.root, f"read-{name}-{who}"), "a").close()
        return batch

    def to_tensors(batch):
        import torch
        rows = torch.tensor(batch["row"], dtype=torch.float32)[:, None]
        return rows / 100, rows

    return raylane.FileSource(paths=os.path.join(cfg.data.root, name), columns=["row"], transform=transform,
                              to_tensors=to_tensors)


def sources(cfg):
    return {"train": _source(cfg, "train"), "eval": {"val": _source(cfg, "val"), "test": _source(cfg, "test")}}


class Seen(raylane.Hook):
    def on_eval_end(self, ctx):
        with open(os.path.join(ctx_root[0], f"eval-end-{ctx.rank}-of-{ctx.world_size}"), "a") as f:
            f.write(f"{ctx.step} {sorted(ctx.metrics)}\\n")


ctx_root = []


def build(cfg):
    import torch
    found = sources(cfg)
    ctx_root.append(cfg.data.root)
    return raylane.Pipeline(model=torch.nn.Linear(1, 1), train_set=found["train"], eval_set=found["eval"],
                            loss_fn=lambda out, rows: torch.nn.functional.mse_loss(out, rows / 100),
                            eval_sums=lambda out, rows: {"row": rows.sum()}, hooks=[Seen()])
"""


@pytest.mark.ray
@pytest.mark.shared_ray
@pytest.mark.untracked
@pytest.mark.slow  # a Ray run with Ray Data: 40 s and more on 2 busy cores (the rest of this file runs in make test)
def test_named_streaming_held_out_sets_are_ray_datasets_of_their_own(run_cli, tmp_path):
    """sources(cfg) with two named held-out FileSources, on 2 Ray workers: each is read by Ray
    Data (not by the ranks) and split so that every row counts once: the mean row id of each
    set, exactly, under its own prefix. The pipeline's hook runs on both Ray workers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "stream.py").write_text(STREAMING)
    (tmp_path / "stream.yaml").write_text("pipeline: ./stream.py\ntrain: {batch_size: 4, max_epochs: 1}\n")
    for name, rows in (("train", range(32)), ("val", range(24)), ("test", range(100, 140))):
        (tmp_path / name).mkdir()
        for part in (0, 1):
            ids = [r for i, r in enumerate(rows) if i % 2 == part]
            pq.write_table(pa.table({"row": ids}), tmp_path / name / f"part-{part}.parquet")
    proc = run_cli(
        "train",
        "stream.yaml",
        "--set",
        f"data.root={tmp_path}",
        "--set",
        "scaling.num_workers=2",
        "--set",
        "run.name=named",
        "--summary-json",
        "s.json",
    )
    assert proc.wait(300) == 0, proc.output
    summary = read_json(tmp_path / "s.json")
    assert summary["status"] == "FINISHED"
    assert summary["metrics"] == {"val/row": pytest.approx(11.5), "test/row": pytest.approx(119.5)}
    for rank in (0, 1):
        assert (tmp_path / f"eval-end-{rank}-of-2").read_text() == f"{summary['steps']} ['test/row', 'val/row']\n"
    read = sorted(p.name for p in tmp_path.glob("read-*"))
    assert {"read-val-task", "read-test-task"} <= set(read) and not [
        r for r in read if r.startswith(("read-val-", "read-test-")) and not r.endswith("-task")
    ], read
