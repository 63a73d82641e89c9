"""Layer 4: the plain Kubernetes objects a raylane deployment holds (Deployment, Service,
ServiceAccount, Secret, ConfigMap, Namespace), against Kubernetes' own schemas.

The schemas are those `kubernetes-validate` (PyPI) bundles for every Kubernetes release, read
offline from the installed package: the strict variant (`additionalProperties: false` on every
object, as kubectl's server-side `fieldValidation=Strict`) of the release the docs name. Its
`$ref`s into `_definitions.json` are inlined here, so that the pruning of nulls and the defaults
(raylane.k8s.schema) walk one tree. Kubernetes' OpenAPI says less than the API server checks in Go:
what raylane adds is in API_SERVER (the values a few fields allow, the defaults a list map's key
takes) and the functions below (names, labels, a Deployment's selector). A RayJob's and a
RayCluster's `metadata` is Kubernetes' ObjectMeta from the same schemas."""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

from raylane.k8s.model import Obj, get

KUBERNETES_VERSION = "1.32"  # the API release docs/k8s-check.md names
KINDS = {
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ServiceAccount"),
    ("v1", "Secret"),
    ("v1", "ConfigMap"),
    ("v1", "Namespace"),
}
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
# What the API server's Go validation and defaulting add to the OpenAPI schemas for these kinds
# (OpenAPI v2 carries no enums for these fields): an unknown Service type is refused on create,
# and a port without a protocol is TCP when two entries of a list map are compared.
API_SERVER: dict[str, dict[str, dict[str, Any]]] = {
    "io.k8s.api.core.v1.ServiceSpec": {
        "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
        "sessionAffinity": {"enum": ["None", "ClientIP"]},
        "externalTrafficPolicy": {"enum": ["Cluster", "Local"]},
        "internalTrafficPolicy": {"enum": ["Cluster", "Local"]},
        "ipFamilyPolicy": {"enum": ["SingleStack", "PreferDualStack", "RequireDualStack"]},
    },
    "io.k8s.api.core.v1.ServicePort": {"protocol": {"enum": ["TCP", "UDP", "SCTP"], "default": "TCP"}},
    "io.k8s.api.core.v1.ContainerPort": {"protocol": {"enum": ["TCP", "UDP", "SCTP"], "default": "TCP"}},
    "io.k8s.api.apps.v1.DeploymentStrategy": {"type": {"enum": ["Recreate", "RollingUpdate"]}},
}
# A Deployment without a spec has no selector, which the API server requires.
REQUIRED = {("apps/v1", "Deployment"): ["spec"]}


def schema_folder() -> str:
    """kubernetes-validate's folder of strict schemas for KUBERNETES_VERSION (its newest release
    not newer, as its own `validate` picks)."""
    from kubernetes_validate import utils

    def minor(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in v.split(".")[:2])

    fits = [v for v in utils.all_versions() if minor(v) <= minor(KUBERNETES_VERSION)]
    if not fits:
        raise RuntimeError(f"kubernetes-validate bundles no schemas for Kubernetes {KUBERNETES_VERSION}")
    return f"kubernetes-json-schema/v{fits[-1]}-local-strict"


def read(name: str) -> Any:
    from kubernetes_validate import utils

    return utils.schema_contents(f"{schema_folder()}/{name}.json", KUBERNETES_VERSION)


@functools.cache
def definitions(quantity: str) -> dict[str, Any]:
    """Kubernetes' definitions, with API_SERVER's additions and a Quantity that must be one
    (`quantity`: Kubernetes' pattern, as KubeRay's CRDs carry it; OpenAPI takes any string)."""
    defs: dict[str, Any] = copy.deepcopy(read("_definitions")["$defs"])
    for name, fields in API_SERVER.items():
        for field, extra in fields.items():
            defs[name]["properties"][field] = {**defs[name]["properties"][field], **extra}
    # A number is a quantity for the API server (1.5 CPUs); a string must match the pattern.
    defs[QUANTITY] = {
        "anyOf": [{"type": "number"}, {"type": "string"}],
        "pattern": quantity,
        "x-kubernetes-int-or-string": True,
    }
    defs[INT_OR_STRING] = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
    return defs


def inlined(node: Any, defs: dict[str, Any], seen: dict[str, Any], stack: tuple[str, ...] = ()) -> Any:
    """`node` with every `$ref` replaced by its definition (each definition built once and shared)."""
    if isinstance(node, list):
        return [inlined(v, defs, seen, stack) for v in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str):
        name = ref.rpartition("/")[2]
        if name in stack:
            raise RuntimeError(f"Kubernetes' {name} refers to itself: it cannot be inlined")
        if name not in seen:
            seen[name] = inlined(defs[name], defs, seen, (*stack, name))
        rest = {k: v for k, v in node.items() if k not in ("$ref", "description")}
        return {**seen[name], **rest} if rest else seen[name]
    out = {k: inlined(v, defs, seen, stack) for k, v in node.items()}
    if isinstance(out.get("type"), list) and "null" in out["type"]:
        # Every type is ['x', 'null'] there; a null the API server keeps is the CRDs' `nullable`,
        # and one it drops (a map's) is pruned before validating (raylane.k8s.schema): what is
        # left, a null in a list, is wrong.
        kept = [t for t in out["type"] if t != "null"]
        out["type"] = kept[0] if len(kept) == 1 else kept
    return out


@functools.cache
def kind_schema(api_version: str, kind: str, quantity: str) -> dict[str, Any] | None:
    """Kubernetes' strict schema of one of KINDS, self-contained; None for another kind."""
    if (api_version, kind) not in KINDS:
        return None
    group, _, version = api_version.rpartition("/")
    name = f"{kind.lower()}-{group.split('.')[0]}-{version}" if group else f"{kind.lower()}-{version}"
    top = {k: v for k, v in read(name).items() if k not in ("$id", "$schema")}
    top["required"] = REQUIRED.get((api_version, kind), [])
    return inlined(top, definitions(quantity), {})


@functools.cache
def object_meta(quantity: str) -> dict[str, Any]:
    """Kubernetes' ObjectMeta, strict (a RayJob's or RayCluster's metadata)."""
    return inlined({"$ref": f"#/$defs/{OBJECT_META}"}, definitions(quantity), {})


DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def label_key_error(key: str) -> str | None:
    """Kubernetes' IsQualifiedName: [prefix/]name, the name ≤ 63 characters, the prefix a DNS subdomain."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not DNS1123_SUBDOMAIN.match(prefix)):
        return f"label key {key!r}: its prefix is not a DNS-1123 subdomain"
    if not name or len(name) > 63 or not QUALIFIED_NAME.match(name):
        return f"label key {key!r}: not a qualified name (alphanumerics, '-', '_', '.'; at most 63)"
    return None


def label_value_error(key: str, value: Any) -> str | None:
    if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
        return f"label {key}={value!r}: not a valid label value (alphanumerics, '-', '_', '.'; at most 63)"
    return None


def meta_checks(obj: Obj) -> list[tuple[str, str, str]]:
    """What the API server checks of every object's metadata: a name (or generateName) of the
    right form for its kind, and label keys and values of Kubernetes' syntax."""
    meta = get(obj.body, "metadata", default={})
    if not isinstance(meta, dict):
        meta = {}  # the schema names a metadata that is not a mapping
    out: list[tuple[str, str, str]] = []
    name = meta.get("name")
    if not name and not meta.get("generateName"):
        out.append(("metadata.name", "schema.name", "missing: every object needs metadata.name"))
    elif isinstance(name, str):
        # Services need a DNS-1035 label (a name that may not start with a digit); RayJob and
        # RayCluster names have the operator's own rule (raylane.k8s.operator).
        if obj.kind == "Service" and (len(name) > 63 or not DNS1035_LABEL.match(name)):
            out.append(("metadata.name", "schema.name", f"{name!r}: a Service name must be a DNS-1035 label"))
        elif len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
            out.append(("metadata.name", "schema.name", f"{name!r}: not a DNS-1123 subdomain (lowercase, '-', '.')"))
    labels = meta.get("labels")
    for key, value in labels.items() if isinstance(labels, dict) else ():
        for error in (label_key_error(str(key)), label_value_error(str(key), value)):
            if error:
                out.append((f"metadata.labels.{key}", "schema.label", error))
    return out


def deployment_checks(obj: Obj) -> list[tuple[str, str, str]]:
    """A Deployment's selector must select its own pod template (the API server's rule)."""
    if obj.kind != "Deployment":
        return []
    wanted = get(obj.body, "spec", "selector", "matchLabels", default={}) or {}
    labels = get(obj.body, "spec", "template", "metadata", "labels", default={}) or {}
    if not isinstance(wanted, dict) or not isinstance(labels, dict):
        return []  # not mappings: the schema names them
    if any(labels.get(k) != v for k, v in wanted.items()):
        return [
            (
                "spec.selector",
                "schema.selector",
                f"matchLabels {wanted} do not select the pod template's labels {labels}",
            )
        ]
    return []
