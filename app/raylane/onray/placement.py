"""Where a run's workers go and what they carry: the scaling section's placement keys as Ray Train's
ScalingConfig takes them, the check that a cluster that cannot grow holds a node for them, and the
`env:` variables handed to each worker before its process group starts.

The `env:` values travel as one object in Ray's object store, never in a runtime env or a train
loop config: Ray logs a runtime env it creates (runtime_env_agent.log) and records both in its
Train state, and a `${NAME}` value is a secret."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import ray

from raylane.config import BaseConfig, ConfigError
from raylane.config.workerenv import resolve

ACCELERATOR_PREFIX = "accelerator_type:"  # Ray's resource for a node's accelerator type
# A node the readonly autoscaler mirrors (a cluster that never grows) is named after its id.
_READONLY_TYPE = re.compile(r"^node_[0-9a-f]+$")


def worker_resources(cfg: BaseConfig) -> dict[str, float]:
    """What each worker asks Ray for (Ray Train adds the accelerator type's own resource)."""
    s = cfg.scaling
    return {"CPU": s.cpus_per_worker, **({"GPU": s.gpus_per_worker} if s.use_gpu else {}), **s.resources_per_worker}


def scaling_options(cfg: BaseConfig) -> dict[str, Any]:
    """ScalingConfig's placement arguments for `cfg` (Ray's defaults where the config says nothing)."""
    s = cfg.scaling
    return {
        "resources_per_worker": worker_resources(cfg),
        "placement_strategy": s.placement_strategy,
        "accelerator_type": s.accelerator_type,
        "label_selector": dict(s.label_selector) or None,
    }


def check_placeable(cfg: BaseConfig, embedded: bool) -> None:
    """Before the run: ConfigError naming the key when no node of the connected cluster can hold
    one worker (its accelerator type, custom resources, labels) and the cluster cannot grow (an
    embedded one, or a joined one without an autoscaler that adds nodes). Bounded: two GCS reads."""
    s = cfg.scaling
    if not (s.accelerator_type or s.resources_per_worker or s.label_selector):
        return
    if not embedded and _may_grow():
        return  # the autoscaler's node types decide; Ray Train asks it for the workers
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    why = unplaceable(cfg, [(n.get("Resources", {}), n.get("Labels", {})) for n in nodes])
    if why:
        raise ConfigError(f"{why}, and this cluster cannot add nodes (no autoscaler): no worker could start")


def unplaceable(cfg: BaseConfig, nodes: Iterable[tuple[Mapping[str, float], Mapping[str, str]]]) -> str | None:
    """The first placement key no node of `nodes` ((resources, labels) each) satisfies, as
    `key = value: why`; None when some node satisfies each."""
    nodes = list(nodes)
    s = cfg.scaling
    if s.accelerator_type and not any(f"{ACCELERATOR_PREFIX}{s.accelerator_type}" in r for r, _ in nodes):
        have = sorted({k[len(ACCELERATOR_PREFIX) :] for r, _ in nodes for k in r if k.startswith(ACCELERATOR_PREFIX)})
        return f"scaling.accelerator_type = {s.accelerator_type!r}: no node has it (the nodes have: {_listed(have)})"
    for name, amount in s.resources_per_worker.items():
        most = max((r.get(name, 0) for r, _ in nodes), default=0)
        if most < amount:
            return f"scaling.resources_per_worker.{name} = {amount:g}: no node has that much (the most is {most:g})"
    for label, wanted in s.label_selector.items():
        if not any(_label_matches(labels.get(label), wanted) for _, labels in nodes):
            seen = sorted({str(labels[label]) for _, labels in nodes if label in labels})
            return f"scaling.label_selector.{label} = {wanted!r}: no node's label matches (the nodes have: {_listed(seen)})"
    return None


def _label_matches(value: str | None, wanted: str) -> bool:
    """Ray's label selector syntax for one label: `a`, `!a`, `in(a,b)`, `!in(a,b)`."""
    negate = wanted.startswith("!")
    body = wanted[1:] if negate else wanted
    choices = [c.strip() for c in body[3:-1].split(",")] if body.startswith("in(") and body.endswith(")") else [body]
    return (value not in choices) if negate else (value in choices)


def _listed(values: list[str]) -> str:
    return ", ".join(values) if values else "none"


def _may_grow() -> bool:
    """Whether an autoscaler may add nodes to the joined cluster: Ray's published cluster config
    names a node group that scales, or the autoscaler reports node types of a config (a readonly
    one, which mirrors a fixed cluster, names each node by its id), or Ray's v2 autoscaler reports."""
    import json

    from raylane.onray.internals import internal_kv_get, ray_state

    config = ray_state.get_cluster_config()
    if config and any(g.max_count == -1 or g.max_count > g.min_count for g in config.node_group_configs):
        return True
    status = internal_kv_get("__autoscaling_status")
    if status:
        report = json.loads(status).get("autoscaler_report") or {}
        types = {t for key in ("active_nodes", "idle_nodes", "pending_launches") for t in report.get(key) or {}}
        return any(not _READONLY_TYPE.match(t) for t in types)
    return os.environ.get("RAY_enable_autoscaler_v2") == "1"  # v2 reports elsewhere: assume it may


def put_env(cfg: BaseConfig, folder: Path | None, launcher: Mapping[str, str] | None = None) -> Any:
    """The `env:` variables (each `${NAME}` read from this, the driver's, environment), and on GPUs
    NCCL's flight recorder's (raylane.loop.observe.hangs, dumping into the run's `folder`), in Ray's
    object store, for the workers; None when there are none. `launcher`: the launcher's own
    variables (a replica group's: raylane.onray.replicas), which win over `env:`."""
    from raylane.loop.observe.hangs import flight_recorder_env

    recorder = flight_recorder_env(
        cfg.scaling.use_gpu, cfg.dist.flight_recorder_entries, str(folder) if folder else None
    )
    # NCCL's flight recorder, before the process group; env: wins over it, the launcher over env:.
    values = {**recorder, **resolve(cfg.env), **(launcher or {})}
    return ray.put(values) if values else None


def set_env(values: Mapping[str, str] | None) -> None:
    """On each worker, before its process group: the run's `env:` variables."""
    if values:
        os.environ.update(values)
