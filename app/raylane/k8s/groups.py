"""What a Ray pod group offers Ray, as Ray's KubeRay autoscaler reads it from the manifest
(`ray/autoscaler/_private/kuberay/autoscaling_config.py`, `_get_ray_resources_from_group_spec`, in
Ray 2.60). A worker group scaled to 0 has no node to ask: what the autoscaler can start for a
request is only what this derivation says, so a resource or accelerator type that it does not
list is never started for."""

from __future__ import annotations

import json
import math
from typing import Any

from raylane.k8s.model import PodGroup, get

STANDARD = ("CPU", "GPU", "TPU", "memory")


def quantity(text: Any) -> float | None:
    """A Kubernetes quantity as a count: 4, "4", "500m", "1k"."""
    if isinstance(text, (int, float)):
        return float(text)
    if not isinstance(text, str):
        return None
    scale = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    try:
        return float(text[:-1]) * scale[text[-1]] if text[-1:] in scale else float(text)
    except ValueError:
        return None


def rounded(text: Any) -> float | None:
    """The autoscaler rounds quantities up (_round_up_k8s_quantity)."""
    value = quantity(text)
    return None if value is None else float(math.ceil(value))


def start_param_resources(text: Any) -> dict[str, float]:
    """rayStartParams `resources`: a JSON object, written as Ray's docs do ('"{\\"a\\": 1}"') or plain."""
    if not isinstance(text, str):
        return {}
    for candidate in (text, text[1:-1].replace("\\", "")):
        try:
            parsed = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            return {str(k): float(v) for k, v in parsed.items() if isinstance(v, (int, float))}
    return {}


def ray_resources(group: PodGroup) -> dict[str, float]:
    """CPU, GPU and custom resources of one pod of the group: the group's `resources` field first,
    then rayStartParams (num-cpus, num-gpus, resources), then the Ray container's limits and
    requests (cpu, any `*gpu`)."""
    declared = group.spec.get("resources") or {}
    params = group.spec.get("rayStartParams") or {}
    k8s = group.ray_container.get("resources") or {}
    out: dict[str, float] = {}
    cpu = declared.get("CPU") if "CPU" in declared else params.get("num-cpus")
    if cpu is None:
        cpu = get(k8s, "limits", "cpu", default=get(k8s, "requests", "cpu"))
    if (value := rounded(cpu)) is not None:
        out["CPU"] = value
    gpu = declared.get("GPU") if "GPU" in declared else params.get("num-gpus")
    if gpu is None:
        limits = {**(k8s.get("requests") or {}), **(k8s.get("limits") or {})}
        gpu = next((v for k, v in limits.items() if str(k).endswith("gpu") and (rounded(v) or 0) > 0), None)
    if (value := rounded(gpu)) is not None:
        out["GPU"] = value
    if declared:
        out.update({k: rounded(v) or 0.0 for k, v in declared.items() if k not in STANDARD})
    else:
        out.update(start_param_resources(params.get("resources")))
    return out


def gpus_per_pod(group: PodGroup) -> float:
    return ray_resources(group).get("GPU", 0.0)


def cpus_per_pod(group: PodGroup) -> float | None:
    return ray_resources(group).get("CPU")
