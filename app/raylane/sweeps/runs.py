"""A sweep's MLflow runs: its parent run, one nested run per trial (opened by the trial, continued
when the trial restarts), and the trials' runs still open. Nothing here imports torch or Ray."""

from __future__ import annotations

import json
from typing import Any

from raylane.config import BaseConfig
from raylane.config.sweep import SweepSection
from raylane.sweeps.results import SWEEP_TAG, TRIAL_TAG
from raylane.tracking.experiment import table_metrics, use_experiment
from raylane.tracking.runs import ERROR_TAG, RUN_NAME_TAG, RunHandle, mlflow_client, run_tags

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests a trial's run under the sweep's
# What a trial's earlier launch ended with, dropped when the trial continues its run.
ENDED_TAGS = ("raylane.early_stopped", "raylane.stopped_at_epoch", ERROR_TAG)


def open_parent(sweep: SweepSection, base: BaseConfig, tracking_uri: str) -> RunHandle:
    """The sweep's parent run: created, or continued when the same sweep name runs again."""
    client = mlflow_client(tracking_uri)
    exp_id = use_experiment(client, base.mlflow.experiment, table_metrics(base, sweep.metric))
    found = [
        r
        for r in client.search_runs([exp_id], filter_string=f"tags.`{SWEEP_TAG}` = '{sweep.name}'")
        if TRIAL_TAG not in r.data.tags
    ]  # the parent: the one run of the sweep that is no trial
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        if ERROR_TAG in found[0].data.tags:  # how an earlier launch ended (interrupted): this one may end otherwise
            client.delete_tag(run_id, ERROR_TAG)
    else:
        tags = {
            **run_tags(base, base.scaling.num_workers),
            SWEEP_TAG: sweep.name,
            RUN_NAME_TAG: sweep.name,
            "raylane.sweep.algorithm": sweep.algorithm,
            "raylane.sweep.scheduler": sweep.scheduler,
        }
        run_id = client.create_run(exp_id, run_name=sweep.name, tags=tags).info.run_id
        from mlflow.entities import Param

        params = [
            Param(f"sweep.{k}", json.dumps(v) if isinstance(v, (dict, list)) else str(v))
            for k, v in sweep.model_dump(mode="json").items()
        ]
        client.log_batch(run_id, params=params)
    return RunHandle(run_id, exp_id, tracking_uri, resumed=bool(found))


def trial_run(client, parent: RunHandle, trial_id: str, sweep: SweepSection, cfg: BaseConfig) -> str:
    """The run of trial `trial_id`, nested under `parent`: created with the trial's resolved config
    as params, or, for a trial that restarted, its own run continued (RUNNING again)."""
    found = client.search_runs(
        [parent.experiment_id],
        max_results=1,
        filter_string=f"tags.`{TRIAL_TAG}` = '{trial_id}' and tags.`{SWEEP_TAG}` = '{sweep.name}'",
    )
    if found:  # the trial restarted: after a failure, a driver's death or interrupt, or a PBT pause
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        for tag in ENDED_TAGS:  # continued, not stopped
            if tag in found[0].data.tags:
                client.delete_tag(run_id, tag)
        return run_id
    tags = {
        **run_tags(cfg, cfg.scaling.num_workers),
        PARENT_TAG: parent.run_id,
        SWEEP_TAG: sweep.name,
        TRIAL_TAG: trial_id,
    }
    run_id = client.create_run(parent.experiment_id, run_name=trial_id, tags=tags).info.run_id
    from mlflow.entities import Param

    flat = cfg.flat()
    batch = [Param(k, str(v)[:6000]) for k, v in flat.items()]
    for i in range(0, len(batch), 100):
        client.log_batch(run_id, params=batch[i : i + 100])
    return run_id


def record_values(client: Any, run_id: str, params: dict[str, Any], donor: dict[str, Any] | None) -> None:
    """The trial's values as `hparam/*` metrics (PBT may change them: a metric, not a param), and
    under a PBT exploit, which trial it continues and how many times it has."""
    if donor:
        exploits = int(client.get_run(run_id).data.tags.get("raylane.pbt.exploits", "0")) + 1
        client.set_tag(run_id, "raylane.pbt.exploits", str(exploits))
        client.set_tag(run_id, "raylane.pbt.last_donor", f"{donor['trial_id']} at step {donor['step']}")
    for key, value in params.items():
        if isinstance(value, (int, float)):
            client.log_metric(run_id, f"hparam/{key}", float(value), step=donor["step"] if donor else 0)


def open_children(client, parent: RunHandle) -> list[str]:
    """The run ids of the sweep's trials whose MLflow runs are RUNNING."""
    runs = client.search_runs(
        [parent.experiment_id],
        filter_string=f"tags.`{PARENT_TAG}` = '{parent.run_id}' and attributes.status = 'RUNNING'",
    )
    return [run.info.run_id for run in runs]


def has_trained(client, run_id: str) -> bool:
    """Whether the trial recording `run_id` has trained: its rank 0 has sent a `train/` metric
    (raylane.loop.reporting), which it does every mlflow.log_every_n_steps steps, 5 s at most
    after the step. Its values as `hparam/*` are there from its start."""
    return any(key.startswith("train/") for key in client.get_run(run_id).data.metrics)
