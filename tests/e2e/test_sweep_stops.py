"""A trial ASHA stops (issue 60, finding 15), with Tune's own stop reaching the trial's process late
on purpose: the sweep's driver holds Tune's loop 20 s after the stop decision
(RAYLANE_TEST_TUNE_STOP_DELAY_S, read where the driver learns of the trial's end), as a busy driver
or an actor Tune keeps for reuse does. Two trials one at a time on the shared head, the seeded
draws' first learning and the second not: ASHA stops the second at its first epoch, every time.
Every step sleeps 250 ms (RAYLANE_FAULTS slow), so an epoch (23 steps) lasts about 6 s.

Before (seen with the old code and this hold): the stopped trial trained on through the hold, to
its run's end, its second epoch evaluated at step 46 by its rank 0 into a run the driver had
already closed KILLED at the stop, which the trial then closed a second time: two writers of one
run. Now: its ranks stop at their next step-boundary vote (the driver asks through the trial's
event sink), and the driver alone closes its run, once rank 0 has sent its last metrics; a trial
closes its own run only when it ran its course, after its whole-run throughput."""

from __future__ import annotations

import pytest

from tests.conftest import cli_env, read_json

STEPS_PER_EPOCH = 23  # digits on 2 workers of batch 32


@pytest.mark.slow  # two trials of ~28 CPU-s one after the other, and the 20 s hold: ~2 minutes
@pytest.mark.shared_ray
def test_a_stopped_trial_stops_at_its_next_step_boundary_and_one_writer_closes_its_run(run_cli, tmp_path):
    from mlflow.tracking import MlflowClient

    env = cli_env(tmp_path, RAYLANE_FAULTS="slow@ms=250", RAYLANE_TEST_TUNE_STOP_DELAY_S="20")
    sets = {
        "sweep.name": "stops",
        "sweep.num_samples": "2",
        "sweep.max_concurrent_trials": "1",
        "train.max_epochs": "2",
        "mlflow.log_every_n_steps": "5",
        "run.storage_path": "runs",
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    sweep = run_cli("tune", "digits-sweep", *args, "--summary-json", "s.json", env=env)
    assert sweep.wait(600) == 0, sweep.output
    s = read_json(tmp_path / "s.json")
    first, second = sorted(s["trials"], key=lambda r: int(r["trial_id"].rsplit("_", 1)[-1]))
    client = MlflowClient(s["tracking_uri"])

    # The first ran its course: closed by itself, after its whole-run throughput.
    assert (first["status"], first["early_stopped"]) == ("FINISHED", False), first
    assert client.get_run(first["run_id"]).data.metrics["run/samples_per_s"] > 0

    # The second, stopped at its first epoch: KILLED by the driver alone, what it was judged on
    # kept once, and nothing trained past the next step boundary after the stop.
    assert (second["status"], second["early_stopped"]) == ("KILLED", True), second
    run = client.get_run(second["run_id"])
    assert run.data.tags["raylane.stopped_at_epoch"] == "1" and "run/samples_per_s" not in run.data.metrics
    evaluations = [(m.step, m.value) for m in client.get_metric_history(second["run_id"], "eval/accuracy")]
    assert evaluations == [(STEPS_PER_EPOCH, pytest.approx(second["metrics"]["accuracy"]))], evaluations
    trained = max(m.step for m in client.get_metric_history(second["run_id"], "train/loss"))
    assert trained < 2 * STEPS_PER_EPOCH, f"trained to step {trained} after its stop at step {STEPS_PER_EPOCH}"
    assert f"trial {second['trial_id']} ended: done (accuracy " in sweep.output
