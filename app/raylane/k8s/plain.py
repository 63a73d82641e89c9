"""Layer 4: the plain Kubernetes objects a raylane deployment holds (Deployment, Service,
ServiceAccount, Secret, ConfigMap, Namespace), as strict JSON schemas.

`kubernetes-validate` (PyPI) bundles Kubernetes' own schemas but is not a dependency of raylane,
so the few kinds needed are written here, field for field from the Kubernetes 1.32 API reference
(apps/v1 Deployment, core/v1 Service, ServiceAccount, Secret, ConfigMap, Namespace, ObjectMeta).
A Deployment's pod template is not written out: it is KubeRay's own copy of Kubernetes'
PodTemplateSpec, taken from the vendored RayCluster CRD (raylane.k8s.schema), which covers the
hard part (containers, volumes, probes, affinity). Status fields are accepted as anything: a
manifest has none, and `kubectl get -o yaml` output carries them."""

from __future__ import annotations

import re
from typing import Any

from raylane.k8s.model import Obj, get

STRING: dict[str, Any] = {"type": "string"}
INTEGER: dict[str, Any] = {"type": "integer"}
BOOLEAN: dict[str, Any] = {"type": "boolean"}
ANYTHING: dict[str, Any] = {"type": "object"}
INT_OR_STRING: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
STRING_MAP: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}


def strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        out["required"] = list(required)
    return out


def array(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


OWNER_REFERENCE = strict(
    {
        "apiVersion": STRING,
        "kind": STRING,
        "name": STRING,
        "uid": STRING,
        "controller": BOOLEAN,
        "blockOwnerDeletion": BOOLEAN,
    },
    ("apiVersion", "kind", "name", "uid"),
)
OBJECT_META = strict(
    {
        "annotations": STRING_MAP,
        "creationTimestamp": {"type": "string", "nullable": True},
        "deletionGracePeriodSeconds": INTEGER,
        "deletionTimestamp": STRING,
        "finalizers": array(STRING),
        "generateName": STRING,
        "generation": INTEGER,
        "labels": STRING_MAP,
        "managedFields": array(ANYTHING),
        "name": STRING,
        "namespace": STRING,
        "ownerReferences": array(OWNER_REFERENCE),
        "resourceVersion": STRING,
        "selfLink": STRING,
        "uid": STRING,
    }
)
LABEL_SELECTOR = strict(
    {
        "matchLabels": STRING_MAP,
        "matchExpressions": array(
            strict({"key": STRING, "operator": STRING, "values": array(STRING)}, ("key", "operator"))
        ),
    }
)
SERVICE_PORT = strict(
    {
        "appProtocol": STRING,
        "name": STRING,
        "nodePort": INTEGER,
        "port": INTEGER,
        "protocol": {"type": "string", "default": "TCP", "enum": ["TCP", "UDP", "SCTP"]},
        "targetPort": INT_OR_STRING,
    },
    ("port",),
)
SERVICE_SPEC = strict(
    {
        "allocateLoadBalancerNodePorts": BOOLEAN,
        "clusterIP": STRING,
        "clusterIPs": array(STRING),
        "externalIPs": array(STRING),
        "externalName": STRING,
        "externalTrafficPolicy": {"type": "string", "enum": ["Cluster", "Local"]},
        "healthCheckNodePort": INTEGER,
        "internalTrafficPolicy": {"type": "string", "enum": ["Cluster", "Local"]},
        "ipFamilies": array(STRING),
        "ipFamilyPolicy": {"type": "string", "enum": ["SingleStack", "PreferDualStack", "RequireDualStack"]},
        "loadBalancerClass": STRING,
        "loadBalancerIP": STRING,
        "loadBalancerSourceRanges": array(STRING),
        "ports": {
            **array(SERVICE_PORT),
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["port", "protocol"],
        },
        "publishNotReadyAddresses": BOOLEAN,
        "selector": STRING_MAP,
        "sessionAffinity": {"type": "string", "enum": ["None", "ClientIP"]},
        "sessionAffinityConfig": strict({"clientIP": strict({"timeoutSeconds": INTEGER})}),
        "trafficDistribution": STRING,
        "type": {"type": "string", "enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
    }
)
OBJECT_REFERENCE = strict(
    {k: STRING for k in ("apiVersion", "fieldPath", "kind", "name", "namespace", "resourceVersion", "uid")}
)


def top(api_version: str, kind: str, fields: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """An object's schema: apiVersion, kind and metadata, and its own fields."""
    head = {
        "apiVersion": {"type": "string", "enum": [api_version]},
        "kind": {"type": "string", "enum": [kind]},
        "metadata": OBJECT_META,
    }
    return strict({**head, **fields}, ("apiVersion", "kind", "metadata", *required))


def deployment(pod_template: dict[str, Any]) -> dict[str, Any]:
    """apps/v1 Deployment around KubeRay's PodTemplateSpec (its metadata made the full ObjectMeta)."""
    template = {**pod_template, "properties": {**pod_template["properties"], "metadata": OBJECT_META}}
    spec = strict(
        {
            "minReadySeconds": INTEGER,
            "paused": BOOLEAN,
            "progressDeadlineSeconds": INTEGER,
            "replicas": INTEGER,
            "revisionHistoryLimit": INTEGER,
            "selector": LABEL_SELECTOR,
            "strategy": strict(
                {
                    "type": {"type": "string", "enum": ["Recreate", "RollingUpdate"]},
                    "rollingUpdate": strict({"maxSurge": INT_OR_STRING, "maxUnavailable": INT_OR_STRING}),
                }
            ),
            "template": template,
        },
        ("selector", "template"),
    )
    return top("apps/v1", "Deployment", {"spec": spec, "status": ANYTHING}, ("spec",))


PLAIN = {
    ("v1", "Service"): top("v1", "Service", {"spec": SERVICE_SPEC, "status": ANYTHING}),
    ("v1", "ServiceAccount"): top(
        "v1",
        "ServiceAccount",
        {
            "automountServiceAccountToken": BOOLEAN,
            "imagePullSecrets": array(strict({"name": STRING})),
            "secrets": array(OBJECT_REFERENCE),
        },
    ),
    ("v1", "Secret"): top(
        "v1", "Secret", {"data": STRING_MAP, "immutable": BOOLEAN, "stringData": STRING_MAP, "type": STRING}
    ),
    ("v1", "ConfigMap"): top("v1", "ConfigMap", {"binaryData": STRING_MAP, "data": STRING_MAP, "immutable": BOOLEAN}),
    ("v1", "Namespace"): top("v1", "Namespace", {"spec": strict({"finalizers": array(STRING)}), "status": ANYTHING}),
}

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
    body, out = obj.body, []
    meta = get(body, "metadata", default={})
    name = meta.get("name") if isinstance(meta, dict) else None
    if not name and not get(meta, "generateName"):
        out.append(("metadata.name", "schema.name", "missing: every object needs metadata.name"))
    elif isinstance(name, str):
        # Services need a DNS-1035 label (a name that may not start with a digit); RayJob and
        # RayCluster names have the operator's own rule (raylane.k8s.operator).
        if obj.kind == "Service" and (len(name) > 63 or not DNS1035_LABEL.match(name)):
            out.append(("metadata.name", "schema.name", f"{name!r}: a Service name must be a DNS-1035 label"))
        elif len(name) > 253 or not DNS1123_SUBDOMAIN.match(name):
            out.append(("metadata.name", "schema.name", f"{name!r}: not a DNS-1123 subdomain (lowercase, '-', '.')"))
    for key, value in (get(meta, "labels", default={}) or {}).items():
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
    if any(labels.get(k) != v for k, v in wanted.items()):
        return [
            (
                "spec.selector",
                "schema.selector",
                f"matchLabels {wanted} do not select the pod template's labels {labels}",
            )
        ]
    return []
