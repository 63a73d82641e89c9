"""What a Ray pod group offers Ray, as Ray's KubeRay autoscaler reads it from the manifest
(`ray/autoscaler/_private/kuberay/autoscaling_config.py`, `_get_ray_resources_from_group_spec`,
and `utils.parse_quantity`, in Ray 2.60). A worker group scaled to 0 has no node to ask: what the
autoscaler can start for a request is only what this derivation says, so a resource or
accelerator type that it does not list is never started for.

A port, not an import: Ray's functions are private (raylane.onray.internals would hold them) and
importing Ray costs more than the whole `raylane k8s check` (measured: 1.3 s against 0.9 s), which
imports no Ray. tests/unit/test_k8s_groups.py compares the two on the same groups and quantities.
Where Ray's autoscaler would raise (no CPU count anywhere, `num-cpus: "1.5"`), the port reads what
it can and leaves the judgement to the rules."""

from __future__ import annotations

import json
from decimal import ROUND_UP, Decimal, InvalidOperation
from typing import Any

from raylane.k8s.model import PodGroup, get

STANDARD = ("CPU", "GPU", "TPU", "memory")
# Kubernetes' suffixes (apimachinery's quantity.go), as Ray's parse_quantity reads them: decimal
# SI (and `K`, which Ray takes too) and binary, as (base, exponent).
SUFFIXES = {
    **{s: (1000, e) for s, e in (("n", -3), ("u", -2), ("m", -1), ("k", 1), ("K", 1), ("M", 2), ("G", 3))},
    **{s: (1000, e) for s, e in (("T", 4), ("P", 5), ("E", 6))},
    **{f"{s}i": (1024, e) for s, e in (("K", 1), ("M", 2), ("G", 3), ("T", 4), ("P", 5), ("E", 6))},
}


def exact(text: Any) -> Decimal | None:
    """A Kubernetes quantity as a number: 4, "4", "500m", "1.5", "2Gi", "1e3"; None if it is none."""
    if isinstance(text, (int, float)):
        return Decimal(text)
    if not isinstance(text, str):
        return None
    number, suffix = text, ""
    for candidate in (text[-2:], text[-1:]):
        if candidate in SUFFIXES and len(text) > len(candidate):
            number, suffix = text[: -len(candidate)], candidate
            break
    try:
        value = Decimal(number)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if suffix:
        base, exponent = SUFFIXES[suffix]
        value *= Decimal(base) ** exponent
    return value


def quantity(text: Any) -> float | None:
    value = exact(text)
    return None if value is None else float(value)


def rounded(text: Any) -> float | None:
    """The autoscaler rounds quantities up (_round_up_k8s_quantity)."""
    value = exact(text)
    return None if value is None else float(value.to_integral_value(rounding=ROUND_UP))


def start_param_resources(text: Any) -> dict[str, float]:
    """rayStartParams `resources`: a JSON object, written as Ray's docs do ('"{\\"a\\": 1}"', the
    form the autoscaler reads) or plain."""
    if not isinstance(text, str):
        return {}
    for candidate in (text[1:-1].replace("\\", ""), text):
        try:
            parsed = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            return {str(k): float(v) for k, v in parsed.items() if isinstance(v, (int, float))}
    return {}


def first(*candidates: Any) -> Any:
    return next((c for c in candidates if c is not None), None)


def ray_resources(group: PodGroup) -> dict[str, float]:
    """CPU, GPU, TPU, memory and custom resources of one pod of the group, each from the group's
    `resources` field first, then rayStartParams (num-cpus, num-gpus, memory, resources), then the
    Ray container's limits and then requests (cpu, memory, any `*gpu`, google.com/tpu)."""
    declared = group.spec.get("resources") or {}
    params = group.spec.get("rayStartParams") or {}
    k8s = group.ray_container.get("resources") or {}
    limits, requests = get(k8s, "limits", default={}) or {}, get(k8s, "requests", default={}) or {}
    out: dict[str, float] = {}
    if declared:
        custom = {k: rounded(v) or 0.0 for k, v in declared.items() if k not in STANDARD}
    else:
        custom = start_param_resources(params.get("resources"))
    for name, key, param in (("CPU", "cpu", "num-cpus"), ("memory", "memory", "memory")):
        value = declared.get(name) if name in declared else first(params.get(param), limits.get(key), requests.get(key))
        if (count := rounded(value)) is not None:
            out[name] = count
    gpu = declared.get("GPU") if "GPU" in declared else params.get("num-gpus")
    if gpu is None:
        gpus = [*limits.items(), *requests.items()]
        gpu = next((v for k, v in gpus if str(k).endswith("gpu") and (rounded(v) or 0) > 0), None)
    if (count := rounded(gpu)) is not None:
        out["GPU"] = count
    tpu = declared.get("TPU") if "TPU" in declared else None
    if tpu is None and "TPU" not in custom:
        tpus = (limits.get("google.com/tpu"), requests.get("google.com/tpu"))
        tpu = next((v for v in tpus if v is not None and (rounded(v) or 0) > 0), None)
    if (count := rounded(tpu)) is not None:
        out["TPU"] = count
    out.update(custom)
    return out


def gpus_per_pod(group: PodGroup) -> float:
    return ray_resources(group).get("GPU", 0.0)


def cpus_per_pod(group: PodGroup) -> float | None:
    return ray_resources(group).get("CPU")
