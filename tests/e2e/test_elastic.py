"""A run whose global batch is held (`train.global_batch`) resumes on another world size at the
same sample: 2 ranks, then 1, then 2 again under torchrun, with a pipeline of the test's own that
writes down every sample index it trains on. Every epoch sees each sample exactly once, every
step the same number of samples, and the steps are the very ones an uninterrupted run takes."""

from __future__ import annotations

import json
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import TORCHRUN, cli_env, read_json

N, GLOBAL, MICRO = 40, 8, 2  # 5 steps an epoch; 2 micro-batches a step on 2 ranks, 4 on 1

PIPELINE = '''
import json, os
import torch
import raylane


class Model(raylane.Section):
    samples: int = 40


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self):
        return ("loss",)


class Recording(torch.nn.Module):
    """Writes the sample indices of each training micro-batch (its input is the index)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x):
        if self.training:
            with open(f"{os.environ['SEEN']}.{os.environ.get('RANK', '0')}", "a") as f:
                f.write(json.dumps([int(i) for i in x[:, 0].tolist()]) + "\\n")
        return self.linear(x)


def build(cfg):
    from torch.utils.data import TensorDataset
    from raylane.loop.protocols.pipeline import Pipeline

    n = cfg.model.samples
    x = torch.arange(n, dtype=torch.float32)[:, None]
    data = TensorDataset(x, x * 0.5)
    return Pipeline(model=Recording(), train_set=data, eval_set=TensorDataset(x[:8], x[:8] * 0.5),
                    loss_fn=torch.nn.functional.mse_loss,
                    eval_sums=lambda o, t: {"loss": torch.nn.functional.mse_loss(o, t, reduction="sum")})
'''


def _steps(seen: Path, world: int, first_step: int) -> dict[int, list[int]]:
    """step -> the samples of that step over all ranks, from each rank's micro-batches in order."""
    accum = GLOBAL // (MICRO * world)
    steps: dict[int, list[int]] = defaultdict(list)
    for rank in range(world):
        lines = Path(f"{seen}.{rank}").read_text().splitlines()
        for i, line in enumerate(lines):
            steps[first_step + i // accum].extend(json.loads(line))
    return dict(steps)


@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "pipe.py").write_text(textwrap.dedent(PIPELINE))
    (tmp_path / "run.yaml").write_text(
        f"pipeline: ./pipe.py\nrun: {{name: elastic, storage_path: {tmp_path / 'runs'}}}\n"
        f"train: {{max_epochs: 3, batch_size: {MICRO}, global_batch: {GLOBAL},"
        " global_batch_adjust: grad_accum_steps}\n"
        "optim: {lr: 0.001}\nmlflow: {enabled: false}\n"
    )
    return tmp_path


def _segment(run_cli, project: Path, world: int, limit: str, name: str, extra: tuple[str, ...] = ()) -> dict:
    env = cli_env(project, SEEN=str(project / name))
    p = run_cli(
        f"--nproc_per_node={world}",
        "-m",
        "raylane",
        "train",
        "run.yaml",
        "--set",
        limit,
        *extra,
        "--summary-json",
        str(project / f"{name}.json"),
        launcher=TORCHRUN,
        env=env,
        cwd=project,
        name=name,
    )
    assert p.wait(180) == 0, p.output
    return read_json(project / f"{name}.json")


def test_resumes_2_to_1_to_2_ranks_see_every_sample_once_per_epoch(run_cli, project):
    a = _segment(run_cli, project, 2, "train.max_steps=3", "a")  # part-way through epoch 0
    # Another global batch cannot continue that epoch: refused before anything starts.
    p = run_cli(
        "train",
        "run.yaml",
        "--local",
        "--set",
        "train.max_steps=6",
        "--set",
        "train.global_batch=4",
        cwd=project,
        name="changed",
    )
    assert p.wait(60) == 2
    assert (
        "train.global_batch = 4: run 'elastic' has a checkpoint part-way through an epoch saved with "
        "train.global_batch = 8"
        in p.output
        and "Traceback" not in p.output
    )
    b = _segment(run_cli, project, 1, "train.max_steps=7", "b")  # the rest of epoch 0, part of epoch 1
    c = _segment(run_cli, project, 2, "train.max_epochs=3", "c")  # to the end of epoch 2
    assert (a["steps"], b["steps"], c["steps"]) == (3, 7, 15) and b["resumed_from_step"] == 3
    steps = {**_steps(project / "a", 2, 1), **_steps(project / "b", 1, 4), **_steps(project / "c", 2, 8)}
    assert sorted(steps) == list(range(1, 16))
    assert all(len(samples) == GLOBAL for samples in steps.values())  # the global batch at every step
    for epoch in range(3):
        seen = [i for step in range(epoch * 5 + 1, epoch * 5 + 6) for i in steps[step]]
        assert sorted(seen) == list(range(N)), (epoch, seen)  # each sample exactly once
    # The same steps as a run on 2 ranks throughout (the order depends on the seed and the epoch
    # only): in-process, test_the_global_order_splits_each_step_and_resumes_at_any_world_size_...


def test_a_global_batch_the_workers_cannot_split_exits_2(run_cli, project):
    bad = run_cli("train", "run.yaml", "--local", "--set", "train.global_batch=7", cwd=project, name="indivisible")
    assert bad.wait(60) == 2
    assert "train.global_batch = 7: not a multiple of train.batch_size = 2 x scaling.num_workers = 1" in bad.output
    assert "Traceback" not in bad.output


def test_an_elastic_run_skips_the_sizes_that_cannot_split_its_global_batch(run_cli, project):
    """[2, 4] workers with 8 samples a step of micro-batches of 2: 3 workers cannot hold it, so the
    run says it will use 2 or 4, and Ray's elastic policy is kept to those (a real policy object:
    the count of workers that fit, 0 to 5, rounds down to a size that splits the batch)."""
    from ray.train import ScalingConfig

    from raylane.config import load_config
    from raylane.config.batching import world_sizes
    from raylane.onray.elastic import HeldBatchElasticPolicy

    ok = run_cli("check", "run.yaml", "--set", "scaling.num_workers=2,4", cwd=project, name="sizes")
    assert ok.wait(60) == 0, ok.output
    assert "elastic run on 2, 4 workers: 3 would not split the global batch" in ok.output
    assert world_sizes(load_config(project / "run.yaml", ["scaling.num_workers=2,4"])) == [2, 4]
    policy = HeldBatchElasticPolicy(ScalingConfig(num_workers=(2, 4)), [2, 4])
    # Ray's reserved resources per node: a list of them on 2.59, a dict by node on 2.60.
    import ray

    def node(cpus):
        return [{"CPU": cpus}] if ray.__version__.startswith("2.59.") else {"node": {"CPU": cpus}}

    assert [policy._count_possible_workers(node(cpus)) for cpus in range(6)] == [0, 1, 2, 2, 4, 4]
    # The smallest size must split it too: the run could not start there.
    bad = run_cli("check", "run.yaml", "--set", "scaling.num_workers=3,4", cwd=project, name="min")
    assert bad.wait(60) == 2
    assert "train.global_batch = 8: not a multiple of train.batch_size = 2 x scaling.num_workers = 3" in bad.output


def test_a_handover_restarts_the_group_without_counting_as_a_failure():
    """Ray Train's own failure policy, given what a group raises after a node's notice (every
    rank checkpointed, then NodeLeaving): retried without using up failure.max_failures; any
    other error, or a mix, is counted as before (here: none allowed)."""
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    from raylane.onray.elastic import HandoverFailurePolicy, NodeLeaving

    policy = HandoverFailurePolicy(FailureConfig(max_failures=0))
    notice = WorkerGroupError("", {0: NodeLeaving("notice"), 1: NodeLeaving("notice")})
    assert [policy.make_decision(notice) for _ in range(3)] == [FailureDecision.RETRY] * 3
    crash = WorkerGroupError("", {0: NodeLeaving("notice"), 1: RuntimeError("boom")})
    assert policy.make_decision(crash) == FailureDecision.RAISE


def test_the_global_order_splits_each_step_and_resumes_at_any_world_size_and_micro_batch():
    from raylane.loop.data.loader import GlobalOrderSampler

    def epoch(world: int, batch: int, skip_samples: int = 0) -> list[list[int]]:
        ranks = []
        for rank in range(world):
            s = GlobalOrderSampler(40, samples_per_step=8, batch_size=batch, rank=rank, world_size=world, seed=3)
            s.set_epoch(2, skip_batches=skip_samples // (batch * world))  # the Trainer's position, in micro-batches
            ranks.append(list(s))
        return ranks

    whole = epoch(2, 2)
    assert sorted(whole[0] + whole[1]) == list(range(40))  # every sample once
    steps = [sorted(whole[0][4 * k : 4 * k + 4] + whole[1][4 * k : 4 * k + 4]) for k in range(5)]
    # Two steps in, on 1 rank with micro-batches of 4, then on 4 ranks with 1: the same steps.
    for world, batch in ((1, 4), (4, 1), (2, 4)):
        rest = epoch(world, batch, skip_samples=16)
        per_rank = 8 // world
        assert [sorted(i for r in rest for i in r[per_rank * k : per_rank * (k + 1)]) for k in range(3)] == steps[2:]
    with pytest.raises(ValueError, match="train.global_batch = 64: more than the 40 training samples"):
        GlobalOrderSampler(40, samples_per_step=64, batch_size=8, rank=0, world_size=2, seed=0)


BLOCKS_PIPELINE = (
    PIPELINE.replace(
        """        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x):
        if self.training:
            with open(f"{os.environ['SEEN']}.{os.environ.get('RANK', '0')}", "a") as f:
                f.write(json.dumps([int(i) for i in x[:, 0].tolist()]) + "\\n")
        return self.linear(x)""",
        """        # Blocks, the unit FSDP shards (raylane.loop.distributed.parallelize.blocks_of).
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(1, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)])

    def forward(self, x):
        if self.training:
            with open(f"{os.environ['SEEN']}.{os.environ.get('RANK', '0')}", "a") as f:
                f.write(json.dumps([int(i) for i in x[:, 0].tolist()]) + "\\n")
        x = x / 256  # the index, scaled: a plain MLP diverges on inputs up to 240
        for block in self.blocks:
            x = block(x)
        return x""",
    )
    .replace("x * 0.5", "x / 512")
    .replace("x[:8] * 0.5", "x[:8] / 512")
)


def _fake_nodes(run_cli, project: Path, nodes: int, limit: str, name: str) -> dict:
    """One torchrun agent per fake node, 2 ranks each, on this machine: a multi-node job as
    torchrun runs it (static rendezvous at rank 0's agent), so HSDP replicates across them."""
    from tests.conftest import free_port

    port = free_port()
    env = cli_env(project, SEEN=str(project / name))
    agents = [
        run_cli(
            f"--nnodes={nodes}",
            "--nproc_per_node=2",
            f"--node_rank={i}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            "-m",
            "raylane",
            "train",
            "run.yaml",
            "--set",
            limit,
            "--summary-json",
            str(project / f"{name}.json"),
            launcher=TORCHRUN[:-1],
            env=env,
            cwd=project,
            name=f"{name}-node{i}",
        )
        for i in range(nodes)
    ]
    for agent in agents:
        assert agent.wait(400) == 0, agent.output
    return read_json(project / f"{name}.json")


@pytest.mark.slow
def test_hsdp_on_8_ranks_over_4_fake_nodes_resized_to_6_and_back(run_cli, tmp_path):
    """docs/scale.md's simulation: HSDP 4 x 2 (8 gloo ranks, 2 per fake node), then 3 x 2 after a
    node is lost, then 4 x 2 again, holding 48 samples a step: each epoch's 240 samples exactly
    once, 48 at every step."""
    samples, held = 240, 48
    (tmp_path / "pipe.py").write_text(textwrap.dedent(BLOCKS_PIPELINE))
    (tmp_path / "run.yaml").write_text(
        f"pipeline: ./pipe.py\nrun: {{name: hsdp, storage_path: {tmp_path / 'runs'}}}\n"
        f"model: {{samples: {samples}}}\nstrategy: {{name: fsdp}}\n"
        f"train: {{max_epochs: 2, batch_size: {MICRO}, global_batch: {held}}}\noptim: {{lr: 0.001}}\n"
        "mlflow: {enabled: false}\n"
    )
    a = _fake_nodes(run_cli, tmp_path, 4, "train.max_steps=2", "a")
    b = _fake_nodes(run_cli, tmp_path, 3, "train.max_steps=6", "b")
    c = _fake_nodes(run_cli, tmp_path, 4, "train.max_steps=10", "c")
    assert [(s["strategy"], s["mesh"], s["world_size"]) for s in (a, b, c)] == [
        ("hsdp", [4, 2], 8),
        ("hsdp", [3, 2], 6),
        ("hsdp", [4, 2], 8),
    ]
    assert (a["steps"], b["steps"], c["steps"]) == (2, 6, 10) and b["resumed_from_step"] == 2

    def steps(name: str, world: int, first: int) -> dict[int, list[int]]:
        accum = held // (MICRO * world)
        out: dict[int, list[int]] = defaultdict(list)
        for rank in range(world):
            for i, line in enumerate(Path(f"{tmp_path / name}.{rank}").read_text().splitlines()):
                out[first + i // accum].extend(json.loads(line))
        return out

    seen = {**steps("a", 8, 1), **steps("b", 6, 3), **steps("c", 8, 7)}
    assert sorted(seen) == list(range(1, 11)) and all(len(v) == held for v in seen.values())
    for epoch in range(2):
        assert sorted(i for k in range(epoch * 5 + 1, epoch * 5 + 6) for i in seen[k]) == list(range(samples))
    # Figures for docs/scale.md: launch to first step of each segment (8 processes on 2 cores).
    print("hsdp segments, launch to first step (s):", [s["timing"]["launch_to_first_step_s"] for s in (a, b, c)])
