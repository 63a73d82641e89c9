"""`raylane tune` on real Ray: ASHA and PBT sweeps of 2-worker digits trials, recorded as nested
MLflow runs (the session's ASHA sweep on the shared MLflow server, the others in sqlite),
reproducible from the seed; a sweep whose driver died continues, and a finished one is never
overwritten."""

from __future__ import annotations

import hashlib
import re
import sqlite3
from pathlib import Path

import pytest

from raylane import cli
from tests.conftest import ASHA_TRIALS, read_json

# Every line a sweep prints: raylane's own, the trials table and the best trial. Not MLflow's
# "View run" links or "Successfully registered model", nor what the raylets push to the driver.
SWEEP_FORMATS = [
    re.compile(p)
    for p in (
        r"joining the local Ray head at \S+ .*",
        r"raylane: (warning: )?.+",
        r"\[raylane\] .+",
        r"[^|]+( \| [^|]+)+",
        r"best trial \S+: .+",
    )
]


def _trial_order(row: dict) -> int:
    return int(row["trial_id"].rsplit("_", 1)[-1])  # Tune numbers trials in creation order


def _runs(db, parent_id: str) -> list[tuple[str, str]]:
    with sqlite3.connect(db) as con:
        return con.execute(
            "SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
            "WHERE t.key = 'mlflow.parentRunId' AND t.value = ?",
            (parent_id,),
        ).fetchall()


def _tags(db, run_id: str) -> dict[str, str]:
    with sqlite3.connect(db) as con:
        return dict(con.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run_id,)).fetchall())


def _hashes(root: Path) -> dict[str, str]:
    """Every file under `root` but the test's own logs: the sweep's folder, MLflow's database and
    artifacts."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.suffix != ".log"
    }


@pytest.mark.shared_ray
def test_asha_sweep_nests_trials_under_a_parent_and_is_reproducible(asha_sweep):
    """The session's ASHA sweep (conftest.asha_sweep, on the shared MLflow server; the browser
    test looks at the same sweep in the UI)."""
    from mlflow.tracking import MlflowClient

    s = asha_sweep.summary
    client = MlflowClient(asha_sweep.tracking_uri)
    assert len(s["trials"]) == ASHA_TRIALS
    parent_run = client.get_run(s["parent_run_id"])
    assert parent_run.info.run_name == s["sweep"] == "digits-asha"
    children = client.search_runs(
        [parent_run.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{s['parent_run_id']}'"
    )
    assert len(children) == ASHA_TRIALS
    assert {c.info.status for c in children} <= {"FINISHED", "KILLED"}
    assert {r["run_id"] for r in s["trials"]} == {c.info.run_id for c in children}
    for row in s["trials"]:
        assert row["status"] in ("FINISHED", "KILLED")
        assert (row["status"] == "KILLED") == row["early_stopped"]
        if row["early_stopped"]:
            assert client.get_run(row["run_id"]).data.tags["raylane.early_stopped"] == "true"
        # What ASHA judged a trial on is in its run, stopped or not (a stop tears the workers
        # down with rank 0's buffered metrics), and a trial that ran to the end has its
        # whole-run throughput (ASHA's stop at max_t came before those records).
        history = client.get_metric_history(row["run_id"], "eval/accuracy")
        assert any(m.value == pytest.approx(row["metrics"]["accuracy"]) for m in history), (row, history)
        # One point a step: a stopped trial's run has one writer (the driver's copy of what Tune
        # judged it on is written only where rank 0's own never came: tests/e2e/test_sweep_stops.py).
        assert len({m.step for m in history}) == len(history), (row, history)
        # The row's value is the trial's last, even where the trial trained on after its stop
        # (issue 47, finding 14).
        last = max(history, key=lambda m: m.step)
        assert (row["metrics"]["accuracy"], row["metrics"]["step"]) == (pytest.approx(last.value), last.step), row
        if row["status"] == "FINISHED":
            assert client.get_run(row["run_id"]).data.metrics["run/samples_per_s"] > 0, row
    parent = parent_run.data.tags
    best = s["best"]
    assert parent["best_trial"] == best["trial_id"] and parent["best_run_id"] == best["run_id"]
    assert best["metric"] == max(r["metrics"]["accuracy"] for r in s["trials"])
    assert best["metric"] > 0.8
    assert s["registered_model"]["name"] == "digits-best"
    assert client.get_registered_model("digits-best").name == "digits-best"
    assert "results.csv" in {a.path for a in client.list_artifacts(s["parent_run_id"])}
    assert "plots/sweep.png" in {a.path for a in client.list_artifacts(s["parent_run_id"], "plots")}
    assert "accuracy" in asha_sweep.output and "best trial" in asha_sweep.output
    assert (
        f"[raylane] sweep digits-asha: {ASHA_TRIALS} trials, 2 at a time, 2 workers per trial; MLflow parent run {s['parent_run_id']}"
        in asha_sweep.output
    )
    foreign = [line for line in asha_sweep.output.splitlines() if not any(f.fullmatch(line) for f in SWEEP_FORMATS)]
    assert not foreign, "\n".join(foreign)

    # The same seed draws the same trial configurations, whatever the trials then do: the sweep's
    # trials are the seeded search's first draws, in order, drawn here again without a cluster.
    first = [r["config"] for r in sorted(s["trials"], key=_trial_order)]
    assert first == _draw("digits-sweep", ASHA_TRIALS) == _draw("digits-sweep", ASHA_TRIALS)
    # What `raylane check digits-sweep` lists is what ran.
    from raylane.config.sweep import load_sweep
    from raylane.onray.sweep_plan import planned_trials

    assert (
        planned_trials(*load_sweep("digits-sweep", [f"sweep.num_samples={ASHA_TRIALS}", "train.max_epochs=3"])) == first
    )
    assert len({(c["optim.lr"], c["model.hidden_size"]) for c in first}) == ASHA_TRIALS  # and they do differ


def _draw(sweep_file: str, n: int) -> list[dict]:
    """The first `n` configurations raylane's search for `sweep_file` hands Tune."""
    from ray.tune.experiment import Experiment

    from raylane.config.sweep import load_sweep
    from raylane.onray.sweep_plan import param_space, search_alg

    sweep, _ = load_sweep(sweep_file, [])
    search = search_alg(sweep, concurrency=n)
    search.add_configurations(
        [Experiment("draw", run=lambda config: None, config=param_space(sweep), num_samples=sweep.num_samples)]
    )
    return [search.next_trial().config for _ in range(n)]


@pytest.mark.shared_ray
@pytest.mark.slow  # ~45 s of epochs for an exploit to happen: make test-all
def test_pbt_sweep_exploits_a_better_trial(run_cli, tmp_path):
    """Two trials, one with a learning rate far too small: at the perturbation PBT makes the worse
    one continue from the better one's checkpoint with perturbed values.

    Asynchronous PBT only clones a trial that it checkpointed while both had a score, so whether
    it exploits at all depends on how far apart the two trials started: it saw no exploit in CI's
    suite at stop 32, on a faster machine, with the trials 6 epochs long. Synchronous PBT pauses
    the first trial at epoch 2 until the second has reached it too, and then always exploits:
    this also tests that a paused trial resumes its own run and is not recorded as stopped.
    One-worker trials: what is tested is the scheduler's, and they start faster (47 s, not 63 s)."""
    sweep = run_cli(
        "tune",
        "digits-sweep",
        "--set",
        "sweep.scheduler=pbt",
        "--set",
        "sweep.name=digits-pbt",
        "--set",
        "sweep.num_samples=1",
        "--set",
        "sweep.algorithm=grid",
        "--set",
        "sweep.space={optim.lr: {grid: [0.00001, 0.01]}}",
        "--set",
        "sweep.pbt_synchronous=true",
        "--set",
        "sweep.perturbation_interval=2",
        "--set",
        "train.max_epochs=3",
        "--set",
        "scaling.num_workers=1",
        "--summary-json",
        "p.json",
        name="pbt",
    )
    assert sweep.wait(500) == 0, sweep.output
    s = read_json(tmp_path / "p.json")
    assert sum(r["exploits"] for r in s["trials"]) == 1, s["trials"]
    exploited = next(r for r in s["trials"] if r["exploits"])
    assert "raylane.pbt.last_donor" in _tags(tmp_path / "mlflow.db", exploited["run_id"])
    assert all(r["status"] == "FINISHED" and not r["early_stopped"] for r in s["trials"]), s["trials"]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("sweep.num_samples=0", "sweep.num_samples = 0"),
        ("sweep.algorithm=bayes", "sweep.algorithm = 'bayes'"),
        ("optim.lr=-1", "optim.lr = -1"),
        (
            "sweep.metric=samples_per_s --set sweep.mode=min",
            "sweep.mode = 'min': samples_per_s is better higher (use sweep.mode: max)",
        ),
        (
            "sweep.global_batch={size: 100} --set sweep.space={train.batch_size: {grid: [16, 32]}}",
            "sweep.global_batch.size = 100: not a multiple of train.batch_size = 16 x scaling.num_workers = 2",
        ),
    ],
)
def test_bad_sweep_input_exits_2_naming_the_field(run_cli, tmp_path, bad, message):
    p = run_cli("tune", "digits-sweep", *[a for part in bad.split(" --set ") for a in ("--set", part)], name="bad")
    assert p.wait(60) == 2
    assert message in p.output and "Traceback" not in p.output


RESUME = [
    "tune",
    "digits-sweep",
    "--set",
    "sweep.scheduler=fifo",
    "--set",
    "sweep.name=digits-resume",
    "--set",
    "sweep.max_concurrent_trials=1",
    "--set",
    "sweep.num_samples=2",
    "--set",
    "train.max_epochs=1",
    "--set",
    "scaling.num_workers=1",
]  # one worker a trial: what is tested is the sweep's record


CHANGES = [  # a setting, and the one line that refuses it
    (
        ["--set", "sweep.metric=loss"],
        "sweep.metric = 'loss': sweep 'digits-resume' already ran with sweep.metric = 'accuracy'",
    ),
    (
        ["--set", "train.max_epochs=2"],
        "train.max_epochs = 2: sweep 'digits-resume' already ran with train.max_epochs = 1",
    ),
    (
        ["--set", "sweep.space={optim.lr: {grid: [0.1]}}"],
        (
            "sweep.space.optim.lr = {'grid': [0.1]}: sweep 'digits-resume' already ran with sweep.space.optim.lr = "
            "{'loguniform': [0.0003, 0.03]}"
        ),
    ),
]


@pytest.mark.slow  # ~75 s; make test keeps a sweep's lease and results (test_lease, test_tune's ASHA sweep)
@pytest.mark.shared_ray
def test_rerunning_a_sweep_after_its_driver_died_continues_it(run_cli, tmp_path, monkeypatch, capsys, no_work):
    """Kill -9 the driver once a trial has finished; the same command continues the sweep under
    the same MLflow parent run instead of starting it over.

    Then nothing recorded is overwritten (issue 21): the finished sweep rerun with changed settings
    is refused before anything starts, rerun unchanged it says it finished and runs nothing, and
    every file of it stays byte-identical. Those reruns run in this process through
    `raylane.cli.main`, with what would start work replaced by a failure (no_work)."""
    import os
    import signal

    from tests.conftest import wait_for

    args = RESUME
    first = run_cli(*args, name="first")
    wait_for(lambda: "[raylane] trial " in first.output or first.proc.poll() is not None, timeout_s=300)
    assert first.proc.poll() is None, first.output
    os.kill(first.proc.pid, signal.SIGKILL)
    first.kill_group()
    again = run_cli(*args, "--summary-json", "r.json", name="again")
    assert again.wait(400) == 0, again.output
    assert "continuing sweep digits-resume" in again.output
    s = read_json(tmp_path / "r.json")
    assert len(s["trials"]) == 2 and all(r["status"] == "FINISHED" for r in s["trials"])
    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        parents = con.execute(
            "SELECT COUNT(*) FROM tags WHERE key = 'raylane.sweep' AND value = 'digits-resume' "
            "AND run_uuid NOT IN (SELECT run_uuid FROM tags WHERE key = 'raylane.trial_id')"
        ).fetchone()
    assert parents == (1,)
    assert len(_runs(db, s["parent_run_id"])) == 2
    with sqlite3.connect(db) as con:  # each trial's eval metric and whole-run throughput (the runs table's columns)
        for row in s["trials"]:
            keys = {k for (k,) in con.execute("SELECT key FROM latest_metrics WHERE run_uuid = ?", (row["run_id"],))}
            assert {"eval/accuracy", "run/samples_per_s"} <= keys, (row["trial_id"], keys)

    before = _hashes(tmp_path)
    assert "runs/digits-resume/raylane_sweep.json" in before and any(p.endswith("results.csv") for p in before)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    for change, line in CHANGES:
        assert cli.main([*RESUME, *change]) == 2, change
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and line in err, err
        assert "start a new sweep with --set sweep.name=digits-resume-2" in err
    # Unchanged: it finished, so it says so and runs nothing.
    assert cli.main(RESUME) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("sweep digits-resume: already FINISHED (2 trials, best trial ") and "Nothing to run" in out
    assert _hashes(tmp_path) == before


def test_trial_resources_pack_fractional_gpus_and_refuse_what_cannot_fit():
    from raylane.config import ConfigError
    from raylane.config.sweep import load_sweep
    from raylane.onray.tune import check_resources, trial_resources

    sweep, base = load_sweep(
        "digits-sweep",
        [
            "scaling.use_gpu=true",
            "scaling.gpus_per_worker=0.25",
            "scaling.num_workers=1",
            "sweep.max_concurrent_trials=null",
        ],
    )
    assert trial_resources(base)["GPU"] == 0.25
    assert check_resources(base, sweep, {"CPU": 16, "GPU": 1}, embedded=True) == 4  # four trials on one GPU
    with pytest.raises(ConfigError, match="scaling.num_workers = 1: one trial needs CPU 1.01, GPU 0.25"):
        check_resources(base, sweep, {"CPU": 16}, embedded=True)
    # A joined cluster may grow: a note, and one trial at a time until it does.
    assert check_resources(base, sweep, {"CPU": 16}, embedded=False) == 1


def test_a_metric_no_trial_reports_ends_the_sweep_at_the_first_report():
    """A user's pipeline may declare no metrics, so `sweep.metric` cannot be checked before the
    sweep; the first report without it stops every trial and names what the trials do report.
    (End to end, the own-model example with sweep.metric=acuracy exits 2 with this line.)"""
    from raylane.config import ConfigError
    from raylane.onray.trials import MetricReported

    ok = MetricReported("accuracy")
    assert not ok("t1", {"accuracy": 0.9, "loss": 0.3, "epoch": 1, "training_iteration": 1})
    assert not ok.stop_all()
    ok.check()

    typo = MetricReported("acuracy")
    assert typo(
        "t1",
        {
            "accuracy": 0.9,
            "loss": 0.3,
            "epoch": 1,
            "step": 10,
            "time_total_s": 2.0,
            "run_id": "x",
            "should_checkpoint": True,
        },
    )
    assert typo.stop_all()
    with pytest.raises(ConfigError, match=r"sweep.metric = 'acuracy': .*\(they report: accuracy, loss\)"):
        typo.check()


def test_throughput_metrics_take_their_direction_and_a_held_global_batch_sets_each_trials_split(tmp_path):
    from raylane.config import ConfigError
    from raylane.config.sweep import load_sweep, trial_config

    (tmp_path / "s.yaml").write_text("sweep: {name: s, base: digits, space: {optim.lr: {grid: [0.1]}}}\n")
    for metric, better in [("samples_per_s", "max"), ("peak_memory_bytes", "min"), ("step_time_s", "min")]:
        sweep, _ = load_sweep(str(tmp_path / "s.yaml"), [f"sweep.metric={metric}"])
        assert sweep.mode == better, metric  # unless the user says otherwise
    with pytest.raises(ConfigError, match="sweep.mode = 'max': peak_memory_bytes is better lower"):
        load_sweep("digits-sweep", ["sweep.metric=peak_memory_bytes"])  # the file says mode: max
    with pytest.raises(ConfigError, match="sweep.metric = 'mfu': on CPU, MFU needs the device's peak"):
        load_sweep("digits-sweep", ["sweep.metric=mfu"])

    space = "sweep.space={train.batch_size: {grid: [8, 16, 32]}, scaling.num_workers: {choice: [1, 2]}}"
    sweep, base = load_sweep("digits-sweep", [space, "sweep.global_batch={size: 64}"])
    for batch, workers in [(8, 1), (8, 2), (16, 2), (32, 1)]:
        cfg = trial_config(base, {"train.batch_size": batch, "scaling.num_workers": workers}, sweep.global_batch)
        assert cfg.train.batch_size * cfg.train.grad_accum_steps * cfg.scaling.num_workers == 64
    sweep, base = load_sweep(
        "digits-sweep",
        [
            "sweep.space={train.grad_accum_steps: {grid: [1, 2, 4]}}",
            "sweep.global_batch={size: 64, adjust: batch_size}",
        ],
    )
    assert [
        trial_config(base, {"train.grad_accum_steps": a}, sweep.global_batch).train.batch_size for a in (1, 2, 4)
    ] == [32, 16, 8]


def test_a_time_to_target_objective_ranks_by_the_first_time_the_metric_reached_it(tmp_path):
    from raylane.config import ConfigError
    from raylane.config.sweep import load_sweep
    from raylane.sweeps.objective import NOT_REACHED_S, Objective

    (tmp_path / "s.yaml").write_text("sweep: {name: s, base: digits, space: {optim.lr: {grid: [0.1]}}}\n")
    target = "sweep.objective={time_to: {metric: accuracy, value: 0.9, mode: max}}"
    sweep, _ = load_sweep(str(tmp_path / "s.yaml"), [target])
    assert (sweep.metric, sweep.mode) == ("time_to_target_s", "min")
    track = Objective(sweep)
    assert track({"accuracy": 0.5, "train_s": 3.0})["time_to_target_s"] == NOT_REACHED_S
    assert track({"accuracy": 0.93, "train_s": 7.5})["time_to_target_s"] == 7.5
    assert track({"accuracy": 0.89, "train_s": 11.0})["time_to_target_s"] == 7.5  # reached once is reached
    with pytest.raises(ConfigError, match="sweep.objective.time_to.metric = 'acc': not a metric"):
        load_sweep(str(tmp_path / "s.yaml"), [target.replace("accuracy", "acc")])
    with pytest.raises(ConfigError, match="sweep.metric = 'accuracy' with sweep.objective"):
        load_sweep("digits-sweep", [target])  # the file names its metric


def test_the_table_shows_each_trials_last_value_and_finished_for_a_trial_that_ran_its_course(
    tmp_path, shared_mlflow_server
):
    """Issue 47, finding 14, from Tune's Result objects and a real MLflow store, as the sweep's
    driver has them when Tune returns: (a) a trial ASHA stopped at its first report had trained all
    4 epochs before the stop reached it; its row showed epoch 1's accuracy (0.1086) while its run
    held 4 epochs, the last 0.1783. (b) A FIFO trial that reached train.max_steps in epoch 2 of 4
    read "FINISHED (early stop)". A trial Tune stopped while it ran is still "KILLED (early stop)"."""
    from mlflow.tracking import MlflowClient
    from ray.tune import Result
    from ray.tune.experiment import Trial

    from raylane.config.sweep import load_sweep
    from raylane.onray.trials import TrialRuns
    from raylane.sweeps import results as sweep_results
    from raylane.sweeps.runs import open_parent, trial_run
    from raylane.tracking.runs import RunHandle, close_run

    # The session's MLflow server (the ASHA sweep's, already up in make test), an experiment of its own.
    sweep, base = load_sweep("digits-sweep", ["sweep.name=table", "mlflow.experiment=sweep-table"])
    uri = shared_mlflow_server.uri
    parent = open_parent(sweep, base, uri)
    client = MlflowClient(uri)
    params = {"optim.lr": 0.001, "model.hidden_size": 64}
    tune_results, runs = [], {}
    # (trial, eval/accuracy at each epoch end (23 steps an epoch), what Tune last received)
    for trial_id, accuracies, reported_epochs in (
        ("t_00000", [0.1086, 0.12, 0.15, 0.1783], 1),  # (a)
        ("t_00001", [0.5, 0.7], 2),  # (b)
        ("t_00002", [0.3], 1),  # stopped while it ran
    ):
        runs[trial_id] = trial_run(client, parent, trial_id, sweep, base.with_run_name())
        for epoch, value in enumerate(accuracies, 1):
            client.log_metric(runs[trial_id], "eval/accuracy", value, step=23 * epoch)
        last = {"accuracy": accuracies[reported_epochs - 1], "epoch": reported_epochs, "step": 23 * reported_epochs}
        tune_results.append(
            Result(
                metrics={**last, "trial_id": trial_id, "config": params},
                checkpoint=None,
                error=None,
                path=str(tmp_path / trial_id),
            )
        )
        trial = Trial("trial", trial_id=trial_id, stub=True)
        trial.update_last_result(last)
        handle = RunHandle(runs[trial_id], parent.experiment_id, uri, False)
        if trial_id == "t_00001":  # its Train run returned (max_steps): the trial closes its run
            close_run(handle, "FINISHED")
        # Tune ends it; a stopped trial writes nothing more: the driver closes its run (no Ray here:
        # no ranks to stop or wait for; that part: tests/e2e/test_sweep_stops.py)
        ended = TrialRuns(parent, sweep, max_epochs=4)
        ended.on_trial_complete(0, [], trial)
        ended.wait()

    rows = sweep_results.rows(tune_results, sweep, parent)
    shown = {
        r["trial_id"]: (r["metrics"]["accuracy"], r["metrics"]["epoch"], r["status"], r["early_stopped"]) for r in rows
    }
    assert shown == {
        "t_00000": (0.1783, 4, "KILLED", True),
        "t_00001": (0.7, 2, "FINISHED", False),
        "t_00002": (0.3, 1, "KILLED", True),
    }
    table = sweep_results.table(rows, sweep).splitlines()
    assert table[2:] == [
        "t_00000 | 0.001 | 64 | 0.1783 | 4 | KILLED (early stop)",
        "t_00001 | 0.001 | 64 | 0.7000 | 2 | FINISHED",
        "t_00002 | 0.001 | 64 | 0.3000 | 1 | KILLED (early stop)",
    ]
    assert sweep_results.best(tune_results, sweep, rows)["trial_id"] == "t_00001"


@pytest.mark.parametrize(
    "space, algorithm, samples, text",
    [
        ("{optim.lr: {grid: [0.01, 0.1]}}", "grid", 1, "2 trials (a grid of 2 points)"),
        ("{optim.lr: {grid: [0.01, 0.1]}}", "random", 1, "2 trials (a grid of 2 points)"),
        (
            "{optim.lr: {grid: [0.01, 0.1]}, model.hidden_size: {choice: [32, 64, 128]}}",
            "grid",
            2,
            "12 trials (a grid of 6 points, 2 samples each)",
        ),
        (
            "{optim.lr: {grid: [0.01, 0.1]}, model.hidden_size: {choice: [32, 64]}}",
            "random",
            3,
            "6 trials (a grid of 2 points, 3 samples each)",
        ),
        ("{optim.lr: {loguniform: [0.001, 0.1]}}", "random", 4, "4 trials"),
        ("{optim.lr: {uniform: [0.001, 0.1]}}", "optuna", 1, "1 trial"),
    ],
)
def test_a_sweep_says_how_many_trials_it_runs(space, algorithm, samples, text):
    """Issue 47, finding 14 (c): a 2-point grid read "1 sample". Tune runs the grid's points
    `num_samples` times each; a choice is a grid under the grid algorithm, a draw otherwise."""
    from raylane.config.sweep import load_sweep
    from raylane.onray.sweep_plan import planned_trials, trial_count, trials_text

    sweep, base = load_sweep(
        "digits-sweep", [f"sweep.space={space}", f"sweep.algorithm={algorithm}", f"sweep.num_samples={samples}"]
    )
    assert trials_text(sweep) == text
    planned = planned_trials(sweep, base)
    assert planned is None if algorithm == "optuna" else len(planned) == trial_count(sweep)


def test_raylane_check_of_a_sweep_file_lists_its_trials_without_starting_ray(monkeypatch, tmp_path, capsys, no_work):
    """Issue 47, finding 14 (d): `raylane check` refused a sweep file ("run it with raylane tune"),
    so a sweep could not be dry-run. Now it prints the sweep's section and each trial it would run,
    as --set overrides of its base config, drawn as `raylane tune` draws them; exit 0, no Ray."""
    import ray

    monkeypatch.chdir(tmp_path)
    assert cli.main(["check", "digits-sweep"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("sweep:\n  name: digits-asha\n")
    assert "# base config: digits with this file's overrides, 4 epochs a trial on 2 workers" in out
    assert "# 4 trials, random search, seed 0; ASHA may stop a trial after 1 epoch:" in out
    listed = [line for line in out.splitlines() if line.startswith("#   ")]
    assert listed == [
        f"#   {n}: --set optim.lr={c['optim.lr']:.6g} --set model.hidden_size={c['model.hidden_size']}"
        for n, c in enumerate(_draw("digits-sweep", 4), 1)
    ]
    # A grid holding the global batch: each point, and the key adjusted to hold it.
    held = [
        "--set",
        "sweep.space={train.batch_size: {grid: [16, 32]}}",
        "--set",
        "sweep.algorithm=grid",
        "--set",
        "sweep.num_samples=1",
        "--set",
        "sweep.global_batch={size: 64}",
    ]
    assert cli.main(["check", "digits-sweep", *held]) == 0
    out = capsys.readouterr().out
    assert "# 2 trials (a grid of 2 points), grid search; ASHA may stop a trial after 1 epoch:" in out
    assert out.endswith(
        "#   1: --set train.batch_size=16 --set train.grad_accum_steps=2\n#   2: --set train.batch_size=32\n"
    )
    # --explain names a key's value in this sweep file, the sweep's own or its base config's.
    for key, value in (("sweep.metric", "accuracy"), ("train.max_epochs", "4")):
        assert cli.main(["check", "digits-sweep", "--explain", key]) == 0
        assert capsys.readouterr().out.endswith(f"  resolved: {value}\n")
    # Bad input: one line, exit 2, as `raylane tune` says it.
    assert cli.main(["check", "digits-sweep", "--set", "sweep.space={optim.lrr: {grid: [0.1]}}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("raylane: sweep.space.optim.lrr: "), err
    assert not ray.is_initialized()
