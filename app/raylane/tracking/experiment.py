"""The experiment, as MLflow 3's UI shows it: marked as model training (the UI's runs, metrics and
models view, not its GenAI one), with raylane's saved view of the runs table (the eval metrics and
the throughput as columns), and the link that opens it so. The runs in it: raylane.tracking.runs."""

from __future__ import annotations

import base64
import json
import logging
import time
import zlib
from typing import Any

from raylane.config import BaseConfig

log = logging.getLogger("raylane.tracking")

# MLflow 3's UI has a GenAI view (traces, judges) and a model-training view (runs, metrics,
# models). This tag says which an experiment is; MLflow 3.17's UI picks its view from the sidebar's
# workflow switch instead (default GenAI: mlflow/mlflow#24498), which the link's workflowType sets.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
# The runs table shows only Source, Models and Dataset until a person picks columns, and keeps
# that choice in their browser. A saved view (an experiment tag, in the UI's Views list, opened by
# ?viewStateShareKey=) is how an experiment offers other columns to everyone.
VIEW_KEY = "raylane"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
# The whole run's (train/* cover a window of steps each); a column shows only once a run logs it.
THROUGHPUT_METRICS = ("run/samples_per_s", "run/tokens_per_s")
_VIEW_START = ["attributes.`Run Name`", "attributes.`Created`"]
_VIEW_ALSO = ["attributes.`Duration`", "attributes.`Models`"]


def experiment_url(base_url: str, experiment_id: str) -> str:
    """The experiment's runs in the model-training view, with raylane's columns."""
    return (
        f"{base_url.rstrip('/')}/#/experiments/{experiment_id}/runs"
        f"?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
    )


def table_metrics(cfg: BaseConfig, sweep_metric: str | None = None) -> list[str]:
    """The metrics the runs table shows: a sweep's metric (its trials', and the parent's best),
    else what the pipeline evaluates (its checkpoint.best_metric when it declares nothing), then
    the training throughput."""
    if sweep_metric:
        main = [f"eval/{sweep_metric}", f"best/{sweep_metric}"]
    else:
        declared = cfg.eval_metrics() or (cfg.checkpoint.best_metric,)
        main = [f"eval/{m}" for m in sorted(declared, key=lambda m: m == "loss")]  # loss after the rest
    return [*main, *THROUGHPUT_METRICS]


def use_experiment(client, name: str, metrics: list[str]) -> str:
    """The id of experiment `name`, created when missing, marked as model training and given
    raylane's view of `metrics`. A kind someone set is kept; the view only gains columns."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(
                name, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND, VIEW_TAG: view_tag_value(None, metrics)}
            )
        except Exception:  # another run created it first: use theirs, below
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    tags = exp.tags or {}
    updates = {} if tags.get(EXPERIMENT_KIND_TAG) else {EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND}
    if (view := view_tag_value(tags.get(VIEW_TAG), metrics)) is not None:
        updates[VIEW_TAG] = view
    for key, value in updates.items():
        try:
            client.set_experiment_tag(exp.experiment_id, key, value)
        except Exception as exc:  # noqa: BLE001 - how the UI shows runs must not stop one
            log.warning("MLflow: could not set experiment tag %s: %s", key, exc)
    return exp.experiment_id


def view_tag_value(existing: str | None, metrics: list[str]) -> str | None:
    """The saved view (the UI's format: a JSON envelope around the JSON of the page's state) with
    a column for each metric; None when `existing` shows them all already or cannot be read."""
    now = int(time.time() * 1000)
    envelope: dict[str, Any] = {"name": VIEW_KEY, "createdAt": now}
    state: dict[str, Any] = {"selectedColumns": list(_VIEW_ALSO)}
    if existing is not None:
        try:
            envelope = json.loads(existing)
            state = json.loads(_inflated(envelope["state"]))
        except (ValueError, KeyError, TypeError, zlib.error):
            return None  # someone else's view under our key: leave it
    # Wide enough for the name: the table cuts a header to its column's width.
    widths = {f"metrics.`{m}`": max(150, 40 + 8 * len(m)) for m in metrics}  # a value: ~15 digits
    missing = [c for c in widths if c not in state.get("selectedColumns", [])]
    if existing is not None and not missing:
        return None
    state["selectedColumns"] = [*state.get("selectedColumns", []), *missing]
    order = state.get("columnOrder") or list(_VIEW_START)
    state["columnOrder"] = [*order, *(c for c in missing if c not in order)]
    state["columnWidths"] = {**{c: widths[c] for c in missing}, **(state.get("columnWidths") or {})}
    return json.dumps({**envelope, "updatedAt": now, "state": json.dumps(state)})


def _inflated(text: str) -> str:
    """A view's state as the UI may store it: JSON, or 'deflate;' and base64 of zlib-deflated JSON."""
    if text.startswith("deflate;"):
        return zlib.decompress(base64.b64decode(text[len("deflate;") :])).decode()
    return text
