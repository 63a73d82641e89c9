"""Each step of a launch done once (issue 61, item 4): a launch finds its run's folder once and
hands it down (the checks, the lease, the MLflow run and what it could not send, the close, the
record), asks its pipeline's questions of one lookup, `raylane submit` loads and checks its
config once, and the command line's run commands are the Python API's calls. Counted on real
launches in this process (an in-process run on a real sqlite MLflow store; a submit up to the
cluster it would upload to), each function counted wherever a module holds it."""

from __future__ import annotations

import ast
import builtins
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import raylane
from raylane import api, cli, pipelines_ref, prechecks, runrecord
from raylane.config import ConfigError, load
from raylane.results import Status
from tests.conftest import cli_env

APP = Path(raylane.__file__).resolve().parent

# A user's pipeline file that counts its own imports (a module imported twice would run twice).
PIPE = """import builtins
import torch
from raylane import BaseConfig, Pipeline

builtins.raylane_test_pipe_imports = getattr(builtins, "raylane_test_pipe_imports", 0) + 1


class Config(BaseConfig):
    model: dict = {}


def build(cfg):
    from torch.utils.data import TensorDataset

    x = torch.rand(64, 4, generator=torch.Generator().manual_seed(0))
    return Pipeline(model=torch.nn.Linear(4, 1), train_set=TensorDataset(x, x.sum(1, keepdim=True)),
                    loss_fn=torch.nn.functional.mse_loss)
"""


class Calls:
    """Every call of the watched functions while inside `watching`, from any thread (the MLflow
    run is opened on a pool): (name, caller's name, what it returned). Each function is replaced
    wherever a module holds it (`from x import f` included; an import inside a function reads the
    module's attribute when it runs), so no import hides a call."""

    def __init__(self, **functions) -> None:
        self.functions = functions
        self.calls: list[tuple[str, str, object]] = []

    def _counting(self, name: str, function):
        def counted(*args, **kwargs):
            returned = function(*args, **kwargs)
            self.calls.append((name, sys._getframe(1).f_code.co_name, returned))
            return returned

        return counted

    @contextmanager
    def watching(self) -> Iterator[Calls]:
        swap = {f: self._counting(name, f) for name, f in self.functions.items()}
        _replace(swap)
        try:
            yield self
        finally:  # a module imported meanwhile took a counting one too
            _replace({counted: f for f, counted in swap.items()})

    def of(self, name: str) -> list[tuple[str, object]]:
        return [(caller, returned) for called, caller, returned in self.calls if called == name]


def _replace(swap: dict) -> None:
    """Each key function, wherever a module holds it, replaced by its value."""
    by_id = {id(f): replacement for f, replacement in swap.items()}
    for module in [m for m in list(sys.modules.values()) if m is not None]:
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if id(value) in by_id and any(value is f for f in swap):
                setattr(module, attr, by_id[id(value)])


@pytest.fixture
def project(tmp_path, monkeypatch):
    env = cli_env(tmp_path)  # an empty sqlite MLflow store, laid out already
    for key in ("MLFLOW_TRACKING_URI", "RAYLANE_HOME"):
        monkeypatch.setenv(key, env[key])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pipe.py").write_text(PIPE)
    (tmp_path / "train.yaml").write_text("pipeline: ./pipe.py\n")
    monkeypatch.setattr(builtins, "raylane_test_pipe_imports", 0, raising=False)
    return tmp_path


def test_a_launch_finds_its_run_folder_once_and_asks_its_pipeline_once(project):
    """One launch, from its checks to its record, and a relaunch that finds it FINISHED: the
    run's folder found once each (before: 8 times in a launch, by the checks, the lease, the
    fresh-start line, the MLflow run's opening and metric logger, its close and the record), the
    pipeline looked up once for the launch's questions (a held global batch asks whether it
    streams) besides its Config and its builds, the user's module imported once."""
    watched = Calls(run_folder=runrecord.run_folder, resolve=pipelines_ref.resolve, load=pipelines_ref.load)
    sets = ["run.name=r", "train.max_steps=2", "train.batch_size=8", "train.global_batch=8", "mlflow.log_model=false"]
    with watched.watching():
        summary = raylane.train("train.yaml", sets, local=True)
    assert summary.status == Status.FINISHED, summary.error
    folder = project / "runs" / "r"
    assert watched.of("run_folder") == [("prepare_train", folder)]
    assert [caller for caller, _ in watched.of("resolve")] == ["prepare_train"]
    # Looked up otherwise only for its Config (the config's class) and to build it (the rank).
    assert {caller for caller, _ in watched.of("load")} <= {"pipeline_config", "resolve", "build_pipeline"}
    assert builtins.raylane_test_pipe_imports == 1
    # The folder handed down reached every place that writes there or reads it back.
    assert (folder / runrecord.RUN_RECORD).is_file()  # the record (raylane.runrecord.record_finished)

    again = Calls(run_folder=runrecord.run_folder)
    with again.watching():
        summary = raylane.train("train.yaml", sets, local=True)
    assert summary.already_finished and again.of("run_folder") == [("prepare_train", folder)]


def test_a_generated_name_finds_its_folder_with_the_name(project):
    """No name in the config: no folder before the name exists, then the named run's, once."""
    watched = Calls(run_folder=runrecord.run_folder)
    with watched.watching():
        summary = raylane.train("train.yaml", ["train.max_steps=1", "mlflow.enabled=false"], local=True)
    assert summary.status == Status.FINISHED, summary.error
    found = [(caller, returned) for caller, returned in watched.of("run_folder") if returned is not None]
    assert found == [("finalize_run", project / "runs" / summary.run_name)]


def test_submit_loads_and_checks_its_config_once(project, monkeypatch):
    """To a cluster on this machine, whose job gets this machine's paths: the config loaded and
    checked once (before: twice, by raylane.api.submit and again by raylane.onray.jobs for the
    paths), and the job's `--set`s as before: the storage and the inputs, absolute. The cluster
    itself is not started here: the address answers nothing, and the submit stops there, after
    the checks (tests/e2e/test_cluster_e2e.py submits to a real head)."""
    from tests.conftest import free_port

    watched = Calls(load_config=load.load_config, check_run=prechecks.check_run)
    address = f"http://127.0.0.1:{free_port()}"
    with watched.watching(), pytest.raises(ConfigError, match="nothing listens|no Ray jobs API|refused"):
        api.submit("train.yaml", ["run.name=j"], address=address)
    assert len(watched.of("load_config")) == 1 and len(watched.of("check_run")) == 1

    from raylane.onray import jobs

    target = jobs.job_target(address)
    cfg = api.prepare_submit("train.yaml", [], here=target.here)
    assert target.here and Path(cfg.run.storage_path).is_absolute()  # as `raylane train` here resolves it
    storage = str((project / "runs").resolve())
    assert jobs._paths_here(cfg, storage) == [f"run.storage_path={storage}"]


def test_the_run_commands_are_the_api_calls_with_every_option():
    """`raylane train/tune/autotune` call raylane.api's function of the same name with every
    option of the command (cli.API_RUNS): an option the parser gains and the table lacks, or one
    the call does not take, fails here rather than being dropped."""
    sub = next(a for a in cli.parser()._actions if a.dest == "command").choices
    for command, options in cli.API_RUNS.items():
        dests = {a.dest for a in sub[command]._actions} - {"help", "config", "overrides", "verbose"}
        assert dests == set(options), command
        takes = inspect.signature(getattr(api, command)).parameters
        assert set(options) <= set(takes), command


def _callers(name: str, module_name: str) -> set[str]:
    """The app's functions (module:function) that call `name` of raylane's `module_name`
    (`module_name.name(...)`, or `name(...)` where it is imported by name), read from the source."""
    found = set()
    for path in APP.rglob("*.py"):
        module = ".".join(path.relative_to(APP.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        imported = module == f"raylane.{module_name}" or any(
            isinstance(n, ast.ImportFrom) and n.module == f"raylane.{module_name}" and name in {a.name for a in n.names}
            for n in ast.walk(tree)
        )
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for call in ast.walk(node):
                    f = getattr(call, "func", None)
                    by_module = (
                        isinstance(f, ast.Attribute) and f.attr == name and getattr(f.value, "id", "") == module_name
                    )
                    if by_module or (imported and isinstance(f, ast.Name) and f.id == name):
                        found.add(f"{module}:{node.name}")
    return found


def test_the_run_folder_is_found_where_a_launch_knows_the_name_and_nowhere_after():
    """On Ray too: the driver hands the folder to the launcher, which hands it to the workers
    (LaunchSpec.run_folder); only a launch that has not found it (a sweep's trial, a search)
    finds it there. Before: also the metric logger, the MLflow run's opening, the close, the
    record, the fresh-start line, the checks of init_from and of a resume, the flight recorder."""
    assert _callers("run_folder", "runrecord") <= {
        "raylane.api:prepare_train",
        "raylane.api:prepare_tune",
        "raylane.api:prepare_check_sweep",
        "raylane.api:_check_autotune",
        "raylane.api:prepare_submit",
        "raylane.driver:finalize_run",  # a name generated, or a launch (a search) that found none
        "raylane.onray.launch:launch_on_ray",  # a sweep's trial, a search
        "raylane.onray.tune:_fit",  # the sweep's base config, for its trials' environment
        "raylane.autotuning.driver:execute",  # a search as torchrun ranks: the flight recorder's
    }


def test_the_pipelines_questions_are_asked_of_one_lookup():
    """Whether the pipeline streams is a property of the launch's one lookup
    (pipelines_ref.Resolved, from `resolve`), not a lookup of its own at each place that asks
    (before: declares_sources, in the layout checks twice, the global batch's check and the Ray
    launcher). The module is otherwise looked up for its Config, to build it, and for sources()."""
    assert _callers("load", "pipelines_ref") <= {
        "raylane.pipelines_ref:resolve",
        "raylane.pipelines_ref:sources",  # calls sources(cfg), on the driver of a streaming Ray run
        "raylane.config.load:pipeline_config",
        "raylane.config_keys:all_models",  # every shipped pipeline's Config, for the reference
        "raylane.loop.usercode:build_pipeline",
        "raylane.loop.usercode:explain",  # which function of the user's raised
    }
    # An embedded Ray cluster's CPUs for Ray Data (raylane.onray.cluster.data_cpus) ask the same
    # question of their own lookup: Ray's one start (start_ray) serves sweeps and searches too.
    assert _callers("resolve", "pipelines_ref") == {
        "raylane.api:prepare_train",
        "raylane.api:prepare_submit",
        "raylane.layout_checks:check_layout",  # called without one (a test, a check outside a launch)
        "raylane.onray.launch:launch_on_ray",  # a sweep's trial, a search
        "raylane.onray.cluster:data_cpus",
    }


def test_the_path_the_architecture_page_lists_is_the_codes():
    """docs/architecture.md lists the functions from `raylane train` to the first optimizer step,
    file by file, with their count: each is defined in the file it is listed under, and the count
    is the table's (a function renamed, moved or gone fails here, not a reader)."""
    page = (APP.parents[1] / "docs" / "architecture.md").read_text()
    section = page.split("### The path to the first optimizer step", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    listed = 0
    for file, functions in rows:
        path = APP / file.strip().strip("`")
        defined = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
        for name in functions.replace("‖ Ray Train ‖", ",").replace("⤷", "").split(","):
            name = name.strip().strip("`").rsplit(".", 1)[-1]
            assert name in defined, f"{file.strip()}: {name}"
            listed += 1
    claimed = section.split("**", 2)[1]  # "22 functions in 10 files"
    assert claimed == f"{listed} functions in {len(rows)} files", claimed


def test_a_local_launchs_stack_at_the_first_optimizer_step_is_the_one_the_page_names(project):
    """The real stack, not the listing: raylane's frames from the API's call to the first
    optimizer step of an in-process launch are the ones docs/architecture.md names for it (before
    this issue's last cut, `driver._execute` stood between `driver.train` and `launch_local`)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    seen: list[list[str]] = []

    def first(optimizer, args, kwargs):  # before every optimizer's step, whichever the run has
        if not seen:
            frames = [f for f in inspect.stack() if Path(f.filename).resolve().is_relative_to(APP)]
            seen.append([f"{Path(f.filename).resolve().relative_to(APP)}:{f.function}" for f in reversed(frames)])

    hook = register_optimizer_step_pre_hook(first)
    try:
        summary = raylane.train("train.yaml", ["train.max_steps=1", "mlflow.enabled=false"], local=True)
    finally:
        hook.remove()
    assert summary.status == Status.FINISHED, summary.error
    assert seen[0] == [
        "api.py:train",
        "driver.py:train",
        "loop/run.py:launch_local",
        "loop/run.py:run_worker",
        "loop/trainer.py:train",
        "loop/trainer.py:_run_epoch",
        "loop/trainer.py:run_step",
    ]
    page = (APP.parents[1] / "docs" / "architecture.md").read_text()
    assert "`cli.main`, `api.train`, `driver.train`, `loop/run.py:launch_local`" in page


def test_the_held_global_batch_is_computed_once_per_world(project):
    """train.global_batch held once, by the checks before anything starts, on the world the run
    will have, and handed to the rank (before: again by run_worker on every rank). The rank
    trains with the held split; MLflow records the config as given."""
    from raylane.config import batching

    watched = Calls(held_batch=batching.held_batch)
    sets = ["run.name=h", "train.max_steps=1", "train.batch_size=4", "train.global_batch=16", "mlflow.enabled=false"]
    with watched.watching():
        summary = raylane.train("train.yaml", sets, local=True)
    assert summary.status == Status.FINISHED, summary.error
    assert [caller for caller, _ in watched.of("held_batch")] == ["of"]  # HeldBatch.of, in prepare_train
    held = watched.of("held_batch")[0][1]
    assert (held.train.batch_size, held.train.grad_accum_steps) == (4, 4)

    # A Ray run's, prepared (no Ray here): held once on scaling.num_workers, for the ranks.
    watched = Calls(held_batch=batching.held_batch)
    with watched.watching():
        run = api.prepare_train("train.yaml", [*sets, "scaling.num_workers=2"])
    assert [caller for caller, _ in watched.of("held_batch")] == ["of"]
    assert run.held is not None and run.held.workers == 2 and run.held.train["grad_accum_steps"] == 2


@pytest.mark.parametrize(
    "sets",
    [
        ["train.global_batch=48", "train.batch_size=4"],
        ["train.global_batch=48", "train.grad_accum_steps=2", "train.global_batch_adjust=batch_size"],
        ["scaling.min_workers=1", "scaling.num_workers=4", "train.batch_size=3"],  # elastic, no global_batch
        [],  # nothing to hold
    ],
)
def test_a_rank_holds_the_batch_again_only_on_another_world(project, sets):
    """What the rank trains with is what holding the given config on its world gives: the
    launch's held section where the worlds agree (held_batch not called), held again where they
    do not (an elastic run's other size)."""
    from raylane.config import batching

    cfg = load.load_config("train.yaml", sets)
    planned = batching.HeldBatch.of(cfg, 4)
    for world in (4, 2):
        watched = Calls(held_batch=batching.held_batch)
        with watched.watching():
            got = batching.held_for(cfg, world, planned)
        assert got == batching.held_batch(cfg, world)
        assert len(watched.of("held_batch")) == (world != 4)
    assert batching.held_for(cfg, 4, None) == batching.held_batch(cfg, 4)
