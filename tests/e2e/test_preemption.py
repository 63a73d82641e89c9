"""Preemption: SIGTERM or Ctrl-C makes every rank checkpoint at the same step and stop cleanly;
a relaunch loses no steps. A second signal, or a rank stuck where it cannot vote, still ends
the run: by escalation or by `dist.timeout_s`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch
from mlflow.tracking import MlflowClient

from raylane.config import load_config
from raylane.loop import checkpoint
from raylane.loop.observe import faults
from raylane.loop.run import build_optimizer
from raylane.pipelines.digits import build_model
from tests.conftest import TORCHRUN, cli_env, read_json, session_processes, wait_for

HANG_LINE = next(i for i, x in enumerate(open(faults.__file__).read().splitlines(), 1) if "time.sleep(3600)" in x)

# Long runs, so that the signal always lands mid-training; the relaunch shortens them.
LONG = ["--set", "train.max_epochs=400", "--set", "checkpoint.every_n_steps=20"]


def _committed(tmp_path, name: str, step: int) -> bool:
    """A checkpoint at `step` or later is committed. Not one step's own: on a fast machine a
    whole run of `keep` checkpoints can pass between two polls, and the step's is pruned."""
    return any(
        int(m.parent.name.rsplit("_", 1)[-1]) >= step
        for m in (tmp_path / "runs" / name).glob(f"checkpoint_*/{checkpoint.MANIFEST_FILE}")
    )


def _assert_stopped_cleanly(proc, summary: dict, *, tracked: bool = True) -> None:
    """`tracked=False` for a test marked untracked: MLflow's KILLED close is the driver's on every
    launcher, and make test checks it in one process (test_mlflow_server)."""
    assert summary["status"] == "KILLED" and summary["preempted"] is True
    assert summary["error"].startswith(f"stopped at step {summary['steps']} (")
    assert summary["checkpoint"].endswith(checkpoint.checkpoint_name(summary["steps"]))
    assert checkpoint.verify(summary["checkpoint"]) is None  # committed, every shard intact
    if tracked:
        assert MlflowClient(summary["tracking_uri"]).get_run(summary["run_id"]).info.status == "KILLED"
    else:
        assert summary["run_id"] is None


def _relaunch_loses_no_steps(run_cli, tmp_path, name: str, stopped: dict, *launch: str, **how) -> dict:
    again = run_cli(
        *launch,
        "--set",
        f"run.name={name}",
        "--set",
        f"train.max_steps={stopped['steps'] + 5}",
        "--set",
        "checkpoint.every_n_steps=20",
        "--summary-json",
        "again.json",
        name="again",
        **how,
    )
    assert again.wait(300) == 0, again.output
    s = read_json(tmp_path / "again.json")
    assert s["resumed_from_step"] == stopped["steps"]  # 0 steps lost
    assert s["run_id"] == stopped["run_id"] and s["status"] == "FINISHED"
    return s


@pytest.mark.ray
@pytest.mark.shared_ray
@pytest.mark.untracked
def test_sigterm_to_the_driver_checkpoints_and_relaunch_loses_nothing(run_cli, tmp_path):
    first = run_cli("train", "digits", "--set", "run.name=pd", "--summary-json", "first.json", *LONG, name="first")
    wait_for(lambda: _committed(tmp_path, "pd", 20), timeout_s=240)
    first.signal(signal.SIGTERM)
    assert first.wait(120) == 130, first.output
    s = read_json(tmp_path / "first.json")
    _assert_stopped_cleanly(first, s, tracked=False)
    assert "a stop request from the driver" in s["error"]
    # Relaunched under torchrun, on as many ranks: what this checks is the checkpoint the stop
    # left (storage is the same for every launcher, as test_s3.py's relaunch), at a Ray run's cost
    # of ~30 CPU-s less. A relaunch on Ray resuming: test_any_model.py's restart after a kill -9.
    torchrun = ["--nproc_per_node", "2", "-m", "raylane", "train", "digits"]
    _relaunch_loses_no_steps(run_cli, tmp_path, "pd", s, *torchrun, launcher=TORCHRUN)


@pytest.mark.slow  # a Ray cluster of its own (~23 s); a worker's notice stopping every rank at one agreed step,
# with its checkpoint, stays in make test (test_a_notice_before_the_loop_starts_still_stops_gracefully)
@pytest.mark.ray
def test_sigterm_to_one_worker_stops_every_rank_at_the_same_step(run_cli, tmp_path):
    first = run_cli("train", "digits", "--set", "run.name=pw", "--summary-json", "first.json", *LONG, name="first")
    wait_for(lambda: _committed(tmp_path, "pw", 20), timeout_s=240)
    workers = wait_for(lambda: session_processes(first.proc.pid, "ray::RayTrainWorker"), timeout_s=30)
    os.kill(workers[-1], signal.SIGTERM)  # a spot reclaim or `kill` on one node
    assert first.wait(120) == 130, first.output
    s = read_json(tmp_path / "first.json")
    _assert_stopped_cleanly(first, s)
    assert s["restarts"] == 0  # a clean stop, not a crash to recover from
    # Both ranks wrote their part of the final checkpoint at the agreed step: rank 0 the (DDP,
    # replicated) state, each rank its random generators.
    final = tmp_path / "runs/pw" / checkpoint.checkpoint_name(s["steps"])
    assert sorted(checkpoint.read_manifest(final)["files"]) == ["state.pt"]


@pytest.mark.slow  # two Ray nodes of its own and two launches (~60 s); make test proves in process that the
# notice is read at failure.max_failures 0 and stops the run (tests/unit/test_drain_notice.py)
@pytest.mark.ray
def test_a_drained_node_stops_every_rank_at_one_step_at_max_failures_0(run_cli, tmp_path):
    """Ray's drain notice to one node of a two-node cluster (`ray drain-node`, as a cloud's spot
    notice or KubeRay's pod termination reaches Ray), with failure.max_failures left at 0: both
    ranks checkpoint at one agreed step and the run ends KILLED, naming the notice; a relaunch on a
    replacement node loses no step. raylane used to read the notice only in a run that restarts."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        leaving = cluster.add_node(num_cpus=1)  # one worker a node: the group's placement group needs both
        launch = ("train", "digits", "--address", cluster.address, "--set", "train.max_epochs=400")
        first = run_cli(*launch, "--set", "run.name=pn", "--summary-json", "first.json", *LONG, name="first")
        wait_for(lambda: _committed(tmp_path, "pn", 20), timeout_s=240)
        drain = [sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", cluster.address]
        drain += ["--node-id", leaving.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION"]
        drain += ["--reason-message", "spot reclaim", "--deadline-remaining-seconds", "60"]
        subprocess.run(drain, check=True, capture_output=True, timeout=60)
        assert first.wait(120) == 130, first.output
        s = read_json(tmp_path / "first.json")
        _assert_stopped_cleanly(first, s)
        assert s["restarts"] == 0, s  # the group was not restarted, by raylane or by Ray's preemption retries
        assert f"(Ray's preemption notice: node {leaving.node_id[:8]} is draining, going in " in s["error"], s
        cluster.add_node(num_cpus=1)  # the replacement, as an autoscaler would start it
        again = _relaunch_loses_no_steps(run_cli, tmp_path, "pn", s, *launch)
        assert again["steps"] == s["steps"] + 5  # it trained on from there (a stop past 12 epochs would not)
    finally:
        cluster.shutdown()


STOP_AT_EPOCH_END = """
import time
import torch
import raylane
from raylane.loop import preemption
from raylane.loop.protocols.pipeline import Pipeline


class Config(raylane.BaseConfig):
    def eval_metrics(self):
        return ("loss",)


class AsksToStop(torch.nn.Module):
    \"\"\"Asks for a graceful stop during its 4th training step: the last of epoch 2. Steps of
    0.3 s, so that the loop votes at every step (about every 0.5 s, at least every step).\"\"\"

    def __init__(self):
        super().__init__()
        self.linear, self.steps = torch.nn.Linear(1, 1), 0

    def forward(self, x):
        if self.training:
            self.steps += 1
            time.sleep(0.3)
            if self.steps == 4:
                preemption.request("a test")
        return self.linear(x)


def build(cfg):
    from torch.utils.data import TensorDataset

    x = torch.arange(8, dtype=torch.float32)[:, None]
    return Pipeline(model=AsksToStop(), train_set=TensorDataset(x, x), eval_set=TensorDataset(x, x),
                    loss_fn=torch.nn.functional.mse_loss,
                    eval_sums=lambda o, t: {"loss": torch.nn.functional.mse_loss(o, t, reduction="sum")})
"""


def test_a_stop_at_an_epoch_end_saves_though_no_checkpoint_was_due(run_cli, tmp_path):
    """Epochs of 2 steps and a checkpoint due every 100 epochs: a stop that lands on the end of
    epoch 2 still checkpoints there (a stop there used to save nothing, and a node's notice then
    lost every step since the last periodic checkpoint)."""
    (tmp_path / "pipe.py").write_text(STOP_AT_EPOCH_END)
    (tmp_path / "run.yaml").write_text("pipeline: ./pipe.py\n")
    p = run_cli(
        "train",
        "run.yaml",
        "--local",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.max_epochs=10",
        "--set",
        "checkpoint.every_n_epochs=100",
        "--set",
        "mlflow.enabled=false",
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
        "--summary-json",
        "s.json",
        cwd=tmp_path,
        name="stop",
    )
    assert p.wait(120) == 130, p.output
    s = read_json(tmp_path / "s.json")
    assert s["steps"] == 4 and s["preempted"] is True
    assert s["checkpoint"].endswith(checkpoint.checkpoint_name(4)) and checkpoint.verify(s["checkpoint"]) is None


NOTICE_DURING_BUILD = """
import os, signal
import torch
import raylane
from raylane.loop.protocols.pipeline import Pipeline


class Config(raylane.BaseConfig):
    def eval_metrics(self):
        return ("loss",)


def build(cfg):
    from torch.utils.data import TensorDataset

    if os.environ.get("RANK") == "1":  # the notice comes while this rank still builds
        os.kill(os.getpid(), signal.SIGTERM)
    x = torch.arange(64, dtype=torch.float32)[:, None] / 64
    return Pipeline(model=torch.nn.Linear(1, 1), train_set=TensorDataset(x, x), eval_set=TensorDataset(x, x),
                    loss_fn=torch.nn.functional.mse_loss,
                    eval_sums=lambda o, t: {"loss": torch.nn.functional.mse_loss(o, t, reduction="sum")})
"""


@pytest.mark.slow  # ~25 s on Ray; make test stops gracefully on a notice mid-run (test_sigterm_to_the_driver_...) and keeps a notice that comes early in-process (tests/unit/test_drain_notice.py)
@pytest.mark.ray
@pytest.mark.shared_ray
def test_a_notice_before_the_loop_starts_still_stops_gracefully(run_cli, tmp_path):
    """SIGTERM to a Ray worker while its pipeline builds (before its loop runs): Ray's own handler
    would end the worker there and fail the run; raylane keeps the notice, and every rank stops
    at the first agreed step with a checkpoint. (Elastic, the group would restart without that
    node: tests/e2e/test_cluster_e2e.py sends its notice as soon as the grown group has started.)"""
    (tmp_path / "pipe.py").write_text(NOTICE_DURING_BUILD)
    (tmp_path / "run.yaml").write_text("pipeline: ./pipe.py\n")
    p = run_cli(
        "train",
        "run.yaml",
        "--set",
        "scaling.num_workers=2",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.max_epochs=50",
        "--set",
        "mlflow.enabled=false",
        "--set",
        f"run.storage_path={tmp_path / 'runs'}",
        "--summary-json",
        "s.json",
        cwd=tmp_path,
        name="early",
    )
    assert p.wait(180) == 130, p.output
    s = read_json(tmp_path / "s.json")
    assert s["preempted"] is True and s["restarts"] == 0, s
    assert 0 < s["steps"] < 50 * 8, s  # stopped early, at a step every rank agreed on
    assert "(a stop request from another rank)" in s["error"], s  # rank 1's notice, not the driver's stop
    assert (
        s["checkpoint"].endswith(checkpoint.checkpoint_name(s["steps"])) and checkpoint.verify(s["checkpoint"]) is None
    )


def _weights(path: str) -> dict[str, torch.Tensor]:
    cfg = load_config("digits")
    model = build_model(cfg.model)
    checkpoint.load(path, model, build_optimizer(model, cfg))
    return model.state_dict()


@pytest.mark.slow  # 3 torchrun launches; the graceful stop and relaunch stay in make test on Ray (SIGTERM to the driver)
def test_ctrl_c_under_torchrun_then_relaunch_is_bit_exact(run_cli, tmp_path):
    """Ctrl-C in a terminal reaches every process of the foreground group: torchrun and both
    ranks. The ranks stop at one agreed step; the resumed run ends bit-identical to a calm one."""
    torchrun = ["--nproc_per_node", "2", "-m", "raylane", "train", "digits"]
    first = run_cli(
        *torchrun, "--set", "run.name=pt", "--summary-json", "first.json", *LONG, launcher=TORCHRUN, name="first"
    )
    wait_for(lambda: _committed(tmp_path, "pt", 40), timeout_s=120)
    os.killpg(first.proc.pid, signal.SIGINT)
    first.wait(120)
    s = read_json(tmp_path / "first.json")
    _assert_stopped_cleanly(first, s)
    total = s["steps"] + 5
    resumed = _relaunch_loses_no_steps(run_cli, tmp_path, "pt", s, *torchrun, launcher=TORCHRUN)
    calm = run_cli(
        *torchrun,
        "--set",
        "run.name=calm",
        "--set",
        f"train.max_steps={total}",
        "--set",
        "checkpoint.every_n_steps=20",
        "--summary-json",
        "calm.json",
        launcher=TORCHRUN,
        name="calm",
    )
    assert calm.wait(120) == 0, calm.output
    reference = _weights(read_json(tmp_path / "calm.json")["checkpoint"])
    for name, tensor in _weights(resumed["checkpoint"]).items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.untracked
def test_a_second_signal_stops_at_once(run_cli, tmp_path):
    """A rank hung outside any collective never reaches the next step boundary: the first Ctrl-C
    cannot be honoured gracefully, the second (after the grace) aborts."""
    proc = run_cli(
        "train",
        "regression",
        "--local",
        "--set",
        "run.name=esc",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, RAYLANE_FAULTS="hang@step=3"),
    )
    wait_for(lambda: "hangs at step 3" in proc.output, timeout_s=60)
    proc.signal(signal.SIGINT)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(3)  # still hung: the first signal only asked
    proc.signal(signal.SIGINT)
    assert proc.wait(30) == 130, proc.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "KILLED" and s["preempted"] is False
    assert "checkpointing at the next step" in proc.output


# ~30 CPU-s, a Ray run: make test names a hung rank and where it stood, with every rank's stack in
# the run's folder and in MLflow, under torchrun (test_hangs.py: the watchdog is the loop's, the same
# on every launcher), and fails a Ray run on a worker's error in one line (test_failures.py).
@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.shared_ray
@pytest.mark.untracked
def test_a_rank_stuck_outside_a_collective_is_reported_within_the_timeout(run_cli, tmp_path):
    proc = run_cli(
        "train",
        "regression",
        "--set",
        "run.name=hang",
        "--set",
        "dist.timeout_s=5",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, RAYLANE_FAULTS="hang@rank=0,step=3"),
    )
    assert proc.wait(180) == 1, proc.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FAILED" and s["restarts"] == 0  # failure.max_failures 0: no restart
    # The one line names the rank that never came and where it stood (the fault hook's sleep); every
    # rank's stack is in the run's folder (raylane.loop.observe.hangs; under torchrun: tests/e2e/test_hangs.py).
    folder = tmp_path / "runs" / "hang" / "stacks"
    assert s["error"] == (
        "training failed on rank 1: a collective waited past dist.timeout_s = 5 s: never reached it: rank 0 on "
        f"{socket.gethostname()} at {faults.__file__}:{HANG_LINE} in before_step; every rank's stack in {folder}"
    ), s["error"]
    host = socket.gethostname()
    assert {x.name for x in folder.iterdir()} == {f"rank0-{host}.txt", f"rank1-{host}.txt"}
    # When the driver heard of the first step: on a busy machine that event can still be on its
    # way when rank 1's timeout fails the run (seen once, with the whole suite 2.5x slower).
    first_step = s["timing"]["first_step_unix"]
    if first_step is not None:
        detected_after_s = s["timing"]["launched_unix"] + s["wall_s"] - first_step
        assert detected_after_s < 5 + 10  # the timeout, plus Ray's teardown
