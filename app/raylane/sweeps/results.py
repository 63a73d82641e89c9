"""A finished sweep's results: one row per trial (its values, metric, MLflow run and status), the
best trial, the table the terminal shows, and what the parent MLflow run records (a CSV of the
rows, a plot of the metric against each searched value, the best trial's tags and model), and
how a trial's MLflow run is found (`find_child`, by the tags the sweep's runs carry). Read from
Tune's result grid after the sweep; nothing here imports torch or Ray."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from raylane.config.sweep import TIME_TO_TARGET, SweepSection
from raylane.sweeps.objective import NOT_REACHED_S
from raylane.tracking.runs import RunHandle, mlflow_client

SWEEP_TAG = "raylane.sweep"
TRIAL_TAG = "raylane.trial_id"


def find_child(client, experiment_id: str, sweep: str, trial_id: str):
    """The MLflow run of trial `trial_id` of sweep `sweep` (None before it has one)."""
    runs = client.search_runs(
        [experiment_id],
        max_results=1,
        filter_string=f"tags.`{TRIAL_TAG}` = '{trial_id}' and tags.`{SWEEP_TAG}` = '{sweep}'",
    )
    return runs[0] if runs else None


def rows(grid, sweep: SweepSection, parent: RunHandle) -> list[dict[str, Any]]:
    client = mlflow_client(parent.tracking_uri)
    rows = []
    for result in grid:
        m = result.metrics or {}
        trial_id = m.get("trial_id") or Path(result.path).name
        run = find_child(client, parent.experiment_id, sweep.name, trial_id)
        tags = run.data.tags if run else {}
        rows.append(
            {
                "trial_id": trial_id,
                "config": {k: result.config.get(k) for k in sweep.space},
                "metrics": last_reported(m, run, sweep.metric),
                "status": run.info.status if run else ("ERROR" if result.error else "UNKNOWN"),
                "early_stopped": tags.get("raylane.early_stopped") == "true",
                "exploits": int(tags.get("raylane.pbt.exploits", "0")),
                "run_id": run.info.run_id if run else m.get("run_id"),
                "checkpoint": m.get("checkpoint_location"),
                "time_s": m.get("time_total_s"),
                "error": str(result.error) if result.error else None,
            }
        )
    return sorted(rows, key=lambda r: r["trial_id"])


def last_reported(result: dict[str, Any], run: Any, metric: str) -> dict[str, Any]:
    """A trial's metric, epoch and step as Tune last received them; or, where the trial's MLflow
    run has a later evaluation of the metric, that one. A trial the scheduler stopped may have
    trained on before the stop reached it (an ASHA stop after epoch 1 of a trial that had trained
    all 4 within the second Tune took to decide): its later reports never reached Tune, and its
    row showed epoch 1's value beside a run holding 4 epochs."""
    shown = {k: v for k, v in result.items() if k == metric or k in ("epoch", "step")}
    step, epoch = result.get("step"), result.get("epoch")
    latest = {p.key: p for p in run.data.to_proto().metrics}.get(f"eval/{metric}") if run else None
    if latest is None or not isinstance(step, int) or step <= 0 or not epoch or latest.step <= step:
        return shown
    # Tune's report came at an epoch's end, so its step and epoch give a trial's steps per epoch
    # (the same throughout a trial: its data, batch and workers do not change).
    return {**shown, metric: latest.value, "step": latest.step, "epoch": epoch * latest.step // step}


def best(grid, sweep: SweepSection, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    scored = [r for r in rows if isinstance(r["metrics"].get(sweep.metric), (int, float))]
    if not scored:
        return None
    pick = (min if sweep.mode == "min" else max)(scored, key=lambda r: r["metrics"][sweep.metric])
    return {
        "trial_id": pick["trial_id"],
        "config": pick["config"],
        "metric": pick["metrics"][sweep.metric],
        "run_id": pick["run_id"],
        "checkpoint": pick["checkpoint"],
    }


def table(rows: list[dict[str, Any]], sweep: SweepSection) -> str:
    keys = list(sweep.space)
    header = ["trial", *keys, sweep.metric, "epochs", "status"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in rows:
        value = r["metrics"].get(sweep.metric)
        status = (
            r["status"]
            + (" (early stop)" if r["early_stopped"] else "")
            + (f" ({r['exploits']} exploits)" if r["exploits"] else "")
        )
        lines.append(
            " | ".join(
                [
                    r["trial_id"],
                    *(
                        f"{r['config'][k]:.4g}" if isinstance(r["config"][k], float) else str(r["config"][k])
                        for k in keys
                    ),
                    shown_metric(sweep.metric, value),
                    str(r["metrics"].get("epoch", "-")),
                    status,
                ]
            )
        )
    return "\n".join(lines)


def shown_metric(metric: str, value: Any) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    if metric == TIME_TO_TARGET and value >= NOT_REACHED_S:
        return "not reached"
    return f"{value:,.0f}" if abs(value) >= 10_000 else f"{value:.4f}"


def record_parent(
    parent: RunHandle,
    sweep: SweepSection,
    rows: list[dict[str, Any]],
    best: dict[str, Any] | None,
    register: str | None,
) -> dict[str, Any]:
    from raylane.tracking.records import attempt, log_model

    client = mlflow_client(parent.tracking_uri)
    out: dict[str, Any] = {}
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["trial_id", *sweep.space, sweep.metric, "epoch", "status", "early_stopped", "exploits", "run_id"])
    for r in rows:
        writer.writerow(
            [
                r["trial_id"],
                *(r["config"][k] for k in sweep.space),
                r["metrics"].get(sweep.metric),
                r["metrics"].get("epoch"),
                r["status"],
                r["early_stopped"],
                r["exploits"],
                r["run_id"],
            ]
        )
    attempt("results table", lambda: client.log_text(parent.run_id, buffer.getvalue(), "results.csv"))
    attempt("sweep plot", lambda: plot(client, parent, sweep, rows))
    if best:
        from mlflow.entities import RunTag

        tags = {
            "best_trial": best["trial_id"],
            "best_run_id": best["run_id"] or "",
            f"best_{sweep.metric}": str(best["metric"]),
        }
        client.log_batch(parent.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        client.log_metric(parent.run_id, f"best/{sweep.metric}", float(best["metric"]))
        if best.get("checkpoint"):
            out.update(attempt("best model", lambda: log_model(parent, best["checkpoint"], register)) or {})
    return out


def plot(client, parent: RunHandle, sweep: SweepSection, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(sweep.space)
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        points = [
            (r["config"][key], r["metrics"].get(sweep.metric))
            for r in rows
            if isinstance(r["metrics"].get(sweep.metric), (int, float))
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            if all(isinstance(x, (int, float)) for x in xs):
                ax.scatter(xs, ys)
                if next(iter(sweep.space[key])) == "loguniform":
                    ax.set_xscale("log")
            else:
                ax.scatter([str(x) for x in xs], ys)
        ax.set_xlabel(key)
        ax.set_ylabel(sweep.metric)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    client.log_figure(parent.run_id, fig, "plots/sweep.png")
    plt.close(fig)
