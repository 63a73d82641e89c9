"""Layers 1 and 4: each object against its schema, the way the API server checks it on create.

A CRD's `openAPIV3Schema` is not what the API server applies as written; plain JSON Schema on it
accepts a misspelled field and rejects KubeRay's own samples. So, as the API server does:
nulls are pruned (unless the field is `nullable`), `default`s are applied, and the schema is strict
(an object that lists `properties` and has neither `additionalProperties` nor
`x-kubernetes-preserve-unknown-fields` takes no other field: kubectl's default server-side
`fieldValidation=Strict`). The CEL rules (`x-kubernetes-validations`) that apply on create are
evaluated by cel-python (rules that read `oldSelf` apply to updates only), and list maps and sets
may hold no two entries with the same key.

The KubeRay schemas are vendored from the operator's CRDs by scripts/kuberay_schemas.py (see
schemas/kuberay-<version>/SOURCE.json for the tag and commit); the plain kinds' schemas and every
object's metadata are Kubernetes' own, from kubernetes-validate (raylane.k8s.plain)."""

from __future__ import annotations

import copy
import functools
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jsonschema import Draft4Validator, Draft202012Validator, validators
from jsonschema.exceptions import ValidationError

from raylane.config import did_you_mean
from raylane.config.sections import short
from raylane.k8s import cel, plain
from raylane.k8s.model import Finding, Obj, dotted

KUBERAY_VERSION = "1.7.0"  # the operator version the docs and the shipped manifests name
SCHEMAS = Path(__file__).resolve().parent / "schemas" / f"kuberay-{KUBERAY_VERSION}"
CRD_FILES = {("ray.io/v1", "RayJob"): "rayjob.v1.json.gz", ("ray.io/v1", "RayCluster"): "raycluster.v1.json.gz"}
KNOWN_KINDS = sorted({k for _, k in CRD_FILES} | {k for _, k in plain.KINDS})


def make_strict(node: Any) -> Any:
    """A copy of a schema with `additionalProperties: false` where the API server is strict."""
    if isinstance(node, list):
        return [make_strict(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: make_strict(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"):
            out[key] = make_strict(value)
        else:
            out[key] = value
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def raw_crd(kind: str) -> dict[str, Any]:
    return json.loads(gzip.decompress((SCHEMAS / CRD_FILES[("ray.io/v1", kind)]).read_bytes()))


def walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every mapping of a schema, at any depth."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


@functools.cache
def quantity_pattern() -> str:
    """Kubernetes' quantity pattern, as the vendored CRDs carry it (a container's resources)."""
    for node in walk(raw_crd("RayCluster")):
        if node.get("x-kubernetes-int-or-string") and "pattern" in node:
            return str(node["pattern"])
    raise RuntimeError(f"KubeRay {KUBERAY_VERSION}'s RayCluster schema has no quantity pattern")


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The vendored v1 schema of a KubeRay kind, strict, its metadata Kubernetes' ObjectMeta."""
    schema = make_strict(raw_crd(kind))
    schema["properties"]["metadata"] = plain.object_meta(quantity_pattern())
    return schema


@functools.cache
def schema_for(api_version: str, kind: str) -> dict[str, Any] | None:
    if (api_version, kind) in CRD_FILES:
        return crd_schema(kind)
    return plain.kind_schema(api_version, kind, quantity_pattern())


def cel_rules() -> set[str]:
    """Every CEL rule of the vendored schemas."""
    return {
        str(rule["rule"])
        for _, kind in CRD_FILES
        for node in walk(raw_crd(kind))
        for rule in node.get("x-kubernetes-validations") or []
    }


def unknown_cel_rules() -> set[str]:
    """CEL rules of the vendored schemas that cel-python cannot compile (a function it lacks)."""
    return {rule for rule in cel_rules() if not cel.on_update(rule) and cel.program(rule) is None}


# -- what the API server does before it validates ---------------------------------------------------


def sub_schema(schema: dict[str, Any], key: Any) -> dict[str, Any]:
    if isinstance(key, int):
        items = schema.get("items")
        return items if isinstance(items, dict) else {}
    props = schema.get("properties") or {}
    if key in props:
        return props[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else {}


def prune_nulls(value: Any, schema: dict[str, Any]) -> Any:
    """The value less every null of a field that is not `nullable` (the API server drops them)."""
    if isinstance(value, dict):
        return {
            k: prune_nulls(v, sub_schema(schema, k))
            for k, v in value.items()
            if v is not None or sub_schema(schema, k).get("nullable")
        }
    if isinstance(value, list):
        return [prune_nulls(v, sub_schema(schema, i)) for i, v in enumerate(value)]
    return value


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fills in each missing field that has a `default`, at every depth (in place)."""
    if isinstance(value, dict):
        for name, prop in (schema.get("properties") or {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
        for k, v in value.items():
            apply_defaults(v, sub_schema(schema, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            apply_defaults(v, sub_schema(schema, i))
    return value


# -- the validator: Draft 4 (OpenAPI 3.0's), with Kubernetes' own keywords ------------------------------


def _type(validator: Any, types: Any, instance: Any, schema: dict[str, Any]) -> Iterator[ValidationError]:
    if instance is None and schema.get("nullable"):
        return
    yield from Draft4Validator.VALIDATORS["type"](validator, types, instance, schema)


def _cel(validator: Any, rules: Any, instance: Any, schema: dict[str, Any]) -> Iterator[ValidationError]:
    for rule in rules:
        if not cel.holds(str(rule.get("rule")), instance):
            yield ValidationError(rule.get("message") or f"fails the CEL rule {rule.get('rule')}")


def _list_type(validator: Any, list_type: Any, instance: Any, schema: dict[str, Any]) -> Iterator[ValidationError]:
    if not isinstance(instance, list) or list_type not in ("map", "set"):
        return
    keys = schema.get("x-kubernetes-list-map-keys") or []
    seen: dict[str, int] = {}
    for i, item in enumerate(instance):
        if list_type == "map" and isinstance(item, dict):
            ident = json.dumps([item.get(k) for k in keys])
            shown = ", ".join(f"{k}={item.get(k)!r}" for k in keys)
        else:
            ident = shown = json.dumps(item, sort_keys=True)
        if ident in seen:
            yield ValidationError(f"duplicate entry ({shown}): the same as [{seen[ident]}]", path=(i,))
        seen.setdefault(ident, i)


KUBERNETES_KEYWORDS = {"type": _type, "x-kubernetes-validations": _cel, "x-kubernetes-list-type": _list_type}
# The CRDs' schemas are OpenAPI 3.0's (JSON Schema draft 4); kubernetes-validate's are 2020-12.
KubeValidator = validators.extend(Draft4Validator, KUBERNETES_KEYWORDS)
PlainValidator = validators.extend(Draft202012Validator, KUBERNETES_KEYWORDS)


@functools.cache
def validator_for(api_version: str, kind: str) -> Any:
    schema = schema_for(api_version, kind)
    if schema is None:
        return None
    return (KubeValidator if (api_version, kind) in CRD_FILES else PlainValidator)(schema)


def check_object(obj: Obj) -> bool:
    """Layer 1 (KubeRay kinds) or 4 (plain kinds): sets obj.body and adds findings. False when no
    schema of this checker covers the object's kind."""
    if not isinstance(obj.raw, dict):
        obj.body = obj.raw
        obj.findings.append(obj.finding("", "schema.object", f"not a mapping: {short(obj.raw)}"))
        return True
    schema = schema_for(obj.api_version, obj.kind)
    if schema is None:
        obj.body = copy.deepcopy(obj.raw)
        if obj.api_version.startswith("ray.io/") and obj.kind in ("RayJob", "RayCluster"):
            message = f"{obj.api_version}: KubeRay {KUBERAY_VERSION} serves {obj.kind} as ray.io/v1; write that"
            obj.findings.append(obj.finding("apiVersion", "schema.api-version", message))
            return True
        return False
    obj.body = apply_defaults(prune_nulls(copy.deepcopy(obj.raw), schema), schema)
    errors = sorted(validator_for(obj.api_version, obj.kind).iter_errors(obj.body), key=lambda e: list(e.absolute_path))
    for error in errors:
        obj.findings.extend(to_findings(obj, error))
    for path, rule, message in plain.meta_checks(obj) + plain.deployment_checks(obj):
        obj.findings.append(obj.finding(path, rule, message))
    return True


def to_findings(obj: Obj, error: ValidationError) -> list[Finding]:
    """One line per broken rule of one jsonschema error."""
    path = dotted(error.absolute_path)
    at = f"{path}." if path else ""
    kind, value = error.validator, error.instance
    schema = error.schema if isinstance(error.schema, dict) else {}
    if kind == "additionalProperties" and isinstance(value, dict):
        known = schema.get("properties") or {}
        return [
            obj.finding(
                f"{at}{extra}",
                "schema.unknown-field",
                f"unknown field{did_you_mean(str(extra), known)}: the API server's strict field validation "
                "rejects it (with --validate=false it would be dropped silently)",
            )
            for extra in sorted(set(value) - set(known), key=str)
        ]
    if kind == "required" and isinstance(value, dict):
        # Draft 4 reports each missing field in an error of its own, named first in its message.
        missing = [n for n in error.validator_value if n not in value and error.message.startswith(repr(n))]
        return [obj.finding(f"{at}{name}", "schema.required", "required field missing") for name in missing]
    if kind == "type":
        message = f"{short(value)} is not of type {error.validator_value}"
    elif kind == "enum":
        message = f"{short(value)} is not one of {', '.join(map(str, error.validator_value))}"
    elif kind == "anyOf" and schema.get("x-kubernetes-int-or-string"):
        pattern = next((s["pattern"] for s in schema["anyOf"] if "pattern" in s), None)
        message = f"{short(value)} is not an integer or a string" + (
            f" of the form {pattern} (a quantity: 4, 500m, 170Gi)" if pattern else ""
        )
    elif kind == "pattern" and schema.get("x-kubernetes-int-or-string"):
        message = f"{short(value)} is not a quantity (e.g. 4, 500m, 170Gi, 1.5)"
    elif kind == "pattern":
        message = f"{short(value)} does not match {error.validator_value}"
    elif kind == "x-kubernetes-validations":
        message = error.message
    elif kind == "x-kubernetes-list-type":
        message = error.message
        kind = "duplicate"
    else:
        message = error.message
    return [obj.finding(path, f"schema.{kind}", message)]
