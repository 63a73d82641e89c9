"""What the checker reads and says: one Kubernetes object as found in a file (`Obj`), one broken
rule (`Finding`), and the walks every layer shares (a Ray cluster spec's pod groups, a container's
environment)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Finding:
    """One broken rule: printed as one line, `FILE: KIND/NAME: FIELD: MESSAGE [RULE]`."""

    source: str  # the file (or the rendered kustomization folder) the object came from
    obj: str  # KIND/NAME, or KIND #N for an object without a name
    path: str  # the field, dotted (spec.rayClusterSpec.workerGroupSpecs[0].maxReplicas); "" for the object
    rule: str  # e.g. schema.unknown-field, operator.min-max-replicas, raylane.storage-path
    message: str
    # Findings of one key are one line (raylane.k8s.check.merged): the same wrong Ray version in
    # rayVersion, the images and the Dockerfile. "": the rule and the message are the key.
    key: str = field(default="", compare=False)

    def line(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.source}: {self.obj}: {where}{self.message} [{self.rule}]"


@dataclass
class Obj:
    """One object of a YAML document, as written (`raw`) and as the API server would store it
    (`body`: nulls pruned, defaults applied; set by the schema layer, else a copy of `raw`)."""

    source: str
    index: int  # the document's number in its file (1-based), for an object without a name
    raw: Any
    folder: str = "."  # where relative paths of the object (a config file) are read from
    body: Any = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return str(self.raw.get("kind", "")) if isinstance(self.raw, dict) else ""

    @property
    def api_version(self) -> str:
        return str(self.raw.get("apiVersion", "")) if isinstance(self.raw, dict) else ""

    @property
    def name(self) -> str:
        meta = self.raw.get("metadata") if isinstance(self.raw, dict) else None
        return str(meta.get("name") or "") if isinstance(meta, dict) else ""

    @property
    def label(self) -> str:
        kind = self.kind or "object"
        return f"{kind}/{self.name}" if self.name else f"{kind} #{self.index}"

    @property
    def namespace(self) -> str:
        """metadata.namespace ("" when the files leave it to `kubectl apply -n`)."""
        return str(get(self.raw, "metadata", "namespace", default="") or "")

    @property
    def annotations(self) -> dict[str, Any]:
        found = get(self.raw, "metadata", "annotations", default={})
        return found if isinstance(found, dict) else {}

    @property
    def seen(self) -> Any:
        """The object as the schema layer stored it, or as written where no schema covers it."""
        return self.raw if self.body is None else self.body

    def finding(self, path: str, rule: str, message: str, key: str = "") -> Finding:
        return Finding(self.source, self.label, path, rule, message, key)


def same_namespace(a: str, b: str) -> bool:
    """Two objects' namespaces agree, or one is left to `kubectl apply -n` and cannot be told."""
    return not a or not b or a == b


def dotted(parts: Any) -> str:
    """A jsonschema path (deque of keys and indexes) as a field path: a.b[0].c."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def get(node: Any, *keys: Any, default: Any = None) -> Any:
    """node[k1][k2]... or `default` where any step is missing or of the wrong type."""
    for key in keys:
        if isinstance(key, int):
            if not isinstance(node, list) or key >= len(node):
                return default
        elif not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


@dataclass(frozen=True)
class PodGroup:
    """A Ray pod group of a cluster spec: the head or one worker group."""

    path: str  # the group's field path, e.g. spec.rayClusterSpec.workerGroupSpecs[1]
    name: str  # "head" or the group's groupName
    spec: dict[str, Any]

    @property
    def is_head(self) -> bool:
        return self.name == "head"

    @property
    def pod(self) -> dict[str, Any]:
        pod = get(self.spec, "template", "spec", default={})
        return pod if isinstance(pod, dict) else {}

    @property
    def ray_container(self) -> dict[str, Any]:
        """KubeRay's Ray container: the first one (utils.RayContainerIndex)."""
        first = get(self.pod, "containers", 0, default={})
        return first if isinstance(first, dict) else {}


def cluster_spec(body: Any) -> tuple[str, dict[str, Any]] | None:
    """(path, spec) of the Ray cluster spec a RayJob or RayCluster holds, or None."""
    kind = body.get("kind") if isinstance(body, dict) else None
    if kind == "RayCluster":
        spec = get(body, "spec")
        return ("spec", spec) if isinstance(spec, dict) else None
    if kind == "RayJob":
        spec = get(body, "spec", "rayClusterSpec")
        return ("spec.rayClusterSpec", spec) if isinstance(spec, dict) else None
    return None


def pod_groups(prefix: str, spec: dict[str, Any]) -> Iterator[PodGroup]:
    head = spec.get("headGroupSpec")
    if isinstance(head, dict):
        yield PodGroup(f"{prefix}.headGroupSpec", "head", head)
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        if isinstance(group, dict):
            yield PodGroup(f"{prefix}.workerGroupSpecs[{i}]", str(group.get("groupName", f"#{i}")), group)


def env_value(container: dict[str, Any], name: str) -> tuple[int, str | None] | None:
    """(index, literal value) of the variable `name` in a container's env (value None when it
    comes from valueFrom), or None when the container does not set it."""
    for i, var in enumerate(container.get("env") or []):
        if isinstance(var, dict) and var.get("name") == name:
            value = var.get("value")
            return i, (None if value is None and "valueFrom" in var else str(value or ""))
    return None
