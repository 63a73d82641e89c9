"""The pod specs an object holds (a RayJob's and a RayCluster's groups and submitter, a
Deployment's template, ...), and what the API server checks of a pod's extended resources, which
no schema holds: Kubernetes' ValidateResourceRequirements (pkg/apis/core/validation) refuses a
container whose extended resource (any `domain/name` outside kubernetes.io: `nvidia.com/gpu`,
`vpc.amazonaws.com/efa`) is requested without an equal limit, and a fractional one. KubeRay hands
Ray the limit (`ray start --num-gpus`), so a request alone would not even count."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from raylane.k8s.groups import quantity
from raylane.k8s.model import cluster_spec, get, pod_groups

Rule = tuple[str, str, str]
# Kinds whose spec.template is a PodTemplateSpec (a CronJob's is one level further down).
TEMPLATED = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "ReplicationController")
CONTAINER_LISTS = ("initContainers", "containers")


def pod_specs(body: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """(field path, pod spec) of every pod the object makes."""
    kind = body.get("kind") if isinstance(body, dict) else None
    found = cluster_spec(body)
    if found:
        for group in pod_groups(*found):
            yield f"{group.path}.template.spec", group.pod
    if kind == "RayJob":
        submitter = get(body, "spec", "submitterPodTemplate", "spec")
        if isinstance(submitter, dict):
            yield "spec.submitterPodTemplate.spec", submitter
    candidates = {
        "Pod": ("spec",),
        "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
        **{k: ("spec", "template", "spec") for k in TEMPLATED},
    }
    keys = candidates.get(str(kind))
    pod = get(body, *keys) if keys else None
    if keys and isinstance(pod, dict):
        yield ".".join(keys), pod


def containers(pod: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path under the pod spec, container) of its init containers and containers."""
    for kind in CONTAINER_LISTS:
        for i, c in enumerate(pod.get(kind) or []):
            if isinstance(c, dict):
                yield f"{kind}[{i}]", c


def is_extended(name: str) -> bool:
    """Kubernetes' IsExtendedResourceName: a `domain/name` outside the kubernetes.io domain."""
    return "/" in name and "kubernetes.io/" not in name and not name.startswith("requests.")


def check_resources(body: Any) -> Iterator[Rule]:
    for path, pod in pod_specs(body):
        for where, c in containers(pod):
            resources = c.get("resources")
            requests = get(resources, "requests", default={}) or {}
            limits = get(resources, "limits", default={}) or {}
            at = f"{path}.{where}.resources"
            for name in sorted(n for n in {*requests, *limits} if is_extended(str(n))):
                asked, held = requests.get(name), limits.get(name)
                if asked is not None and held is None:
                    yield (
                        f"{at}.limits",
                        "pod.extended-resource",
                        (
                            f"{name}: requested ({asked}) with no limit: the API server refuses the pod (an extended "
                            "resource is never overcommitted: its request needs an equal limit), and KubeRay gives Ray "
                            "the limit's GPUs"
                        ),
                    )
                elif asked is not None and quantity(asked) != quantity(held):
                    yield (
                        f"{at}.requests",
                        "pod.extended-resource",
                        (
                            f"{name}: requests {asked}, limits {held}: the API server refuses a request that differs "
                            "from the limit of an extended resource; set both to what one pod holds"
                        ),
                    )
                elif (count := quantity(held)) is not None and count != int(count):
                    yield (
                        f"{at}.limits",
                        "pod.extended-resource",
                        f"{name}: {held}: an extended resource is counted in whole units",
                    )
