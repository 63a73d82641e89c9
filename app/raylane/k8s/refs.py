"""References between the objects of one deployment: the Secrets, ConfigMaps, ServiceAccounts and
claims a pod (or a RayCluster's token) names must exist, and the pods that write checkpoints to a
bucket must all have a way to it.

A name that no object of the files defines fails, unless the files declare it made elsewhere
(a Secret is rarely committed beside the manifests): the annotation `raylane.io/external` on any
object of the deployment lists `Kind/name` entries, comma-separated. A platform team wants a
misspelt name caught before the pod sits in CreateContainerConfigError; declaring the others takes
one line. Optional references (`optional: true`) and the namespace's `default` account need none."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from raylane.config import BaseConfig
from raylane.k8s.model import Obj, PodGroup, cluster_spec, get, same_namespace
from raylane.k8s.pods import containers, pod_specs

Rule = tuple[str, str, str]
EXTERNAL = "raylane.io/external"
RULES = {
    "Secret": "ref.secret",
    "ConfigMap": "ref.config-map",
    "ServiceAccount": "ref.service-account",
    "PersistentVolumeClaim": "ref.claim",
}
WHAT_FAILS = {
    "Secret": "the pod would not start (CreateContainerConfigError, or a volume never mounted)",
    "ConfigMap": "the pod would not start (CreateContainerConfigError, or a volume never mounted)",
    "ServiceAccount": "no pod of it is created (error looking up service account)",
    "PersistentVolumeClaim": "the pod would stay Pending",
}
# What gives a pod a cloud identity for a bucket: its account's workload-identity annotation
# (IRSA, GKE Workload Identity, Azure Workload Identity) or credentials in its environment.
ROLE_ANNOTATIONS = ("eks.amazonaws.com/role-arn", "iam.gke.io/gcp-service-account", "azure.workload.identity/client-id")
CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_CLIENT_ID",
)


@dataclass(frozen=True)
class Ref:
    kind: str
    name: str
    path: str


def references(body: Any) -> Iterator[Ref]:
    """Every required reference of one object (optional ones left out)."""
    found = cluster_spec(body)
    if found and isinstance(secret := get(found[1], "authOptions", "secretName"), str):
        yield Ref("Secret", secret, f"{found[0]}.authOptions.secretName")
    for path, pod in pod_specs(body):
        account = pod.get("serviceAccountName") or pod.get("serviceAccount")
        if isinstance(account, str) and account != "default":
            yield Ref("ServiceAccount", account, f"{path}.serviceAccountName")
        for i, pull in enumerate(pod.get("imagePullSecrets") or []):
            if isinstance(pull, dict) and pull.get("name"):
                yield Ref("Secret", str(pull["name"]), f"{path}.imagePullSecrets[{i}].name")
        for i, volume in enumerate(pod.get("volumes") or []):
            if isinstance(volume, dict):
                yield from volume_refs(volume, f"{path}.volumes[{i}]")
        for where, c in containers(pod):
            yield from container_refs(c, f"{path}.{where}")


def volume_refs(volume: dict[str, Any], at: str) -> Iterator[Ref]:
    sources = [("", volume)]
    sources += [(f".projected.sources[{j}]", s) for j, s in enumerate(get(volume, "projected", "sources") or [])]
    for sub, source in sources:
        if not isinstance(source, dict):
            continue
        for key, kind, name_key in (
            ("secret", "Secret", "secretName" if not sub else "name"),
            ("configMap", "ConfigMap", "name"),
        ):
            ref = source.get(key)
            if isinstance(ref, dict) and ref.get(name_key) and not ref.get("optional"):
                yield Ref(kind, str(ref[name_key]), f"{at}{sub}.{key}.{name_key}")
    claim = get(volume, "persistentVolumeClaim", "claimName")
    if claim:
        yield Ref("PersistentVolumeClaim", str(claim), f"{at}.persistentVolumeClaim.claimName")


def container_refs(c: dict[str, Any], at: str) -> Iterator[Ref]:
    for i, var in enumerate(c.get("env") or []):
        for key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
            ref = get(var, "valueFrom", key)
            if isinstance(ref, dict) and ref.get("name") and not ref.get("optional"):
                yield Ref(kind, str(ref["name"]), f"{at}.env[{i}].valueFrom.{key}.name")
    for i, source in enumerate(c.get("envFrom") or []):
        for key, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
            ref = get(source, key)
            if isinstance(ref, dict) and ref.get("name") and not ref.get("optional"):
                yield Ref(kind, str(ref["name"]), f"{at}.envFrom[{i}].{key}.name")


def declared_external(objects: list[Obj]) -> tuple[set[tuple[str, str]], list[tuple[Obj, str]]]:
    """The (kind, name) pairs the deployment declares made elsewhere, and the entries that are not
    `Kind/name` of a kind this check resolves (with the object that wrote them)."""
    out: set[tuple[str, str]] = set()
    bad: list[tuple[Obj, str]] = []
    for obj in objects:
        for entry in re.split(r"[,\s]+", str(obj.annotations.get(EXTERNAL, "") or "")):
            kind, _, name = entry.partition("/")
            if not entry:
                continue
            if kind in RULES and name:
                out.add((kind, name))
            else:
                bad.append((obj, entry))
    return out, bad


def check_references(obj: Obj, objects: list[Obj], external: set[tuple[str, str]]) -> Iterator[Rule]:
    for ref in references(obj.seen):
        if (ref.kind, ref.name) in external or defines(objects, ref.kind, ref.name, obj.namespace):
            continue
        yield ref.path, RULES[ref.kind], unresolved(ref, obj, objects, external)


def defines(objects: list[Obj], kind: str, name: str, namespace: str) -> bool:
    return any(o.kind == kind and o.name == name and same_namespace(o.namespace, namespace) for o in objects)


def unresolved(ref: Ref, obj: Obj, objects: list[Obj], external: set[tuple[str, str]]) -> str:
    known = sorted({o.name for o in objects if o.kind == ref.kind} | {n for k, n in external if k == ref.kind})
    elsewhere = [o for o in objects if o.kind == ref.kind and o.name == ref.name]
    if elsewhere:
        where = f" in namespace {obj.namespace!r} (one is in {elsewhere[0].namespace!r})"
    else:
        close = difflib.get_close_matches(ref.name, known, n=1)
        where = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"{ref.kind} {ref.name!r}: not in these files{where}: {WHAT_FAILS[ref.kind]}. Made outside them? "
        f"Declare it: annotation {EXTERNAL}: {ref.kind}/{ref.name}"
    )


# -- the bucket --------------------------------------------------------------------------------------


def check_storage_identity(
    cfg: BaseConfig, groups: list[PodGroup], objects: list[Obj], namespace: str, run_env: set[str]
) -> Iterator[Rule]:
    """With checkpoints in a bucket, a Ray pod group without the identity the others reach it by
    (a workload-identity account, credentials in its environment) fails at its ranks' first save.
    Where no group has one, the nodes' own role may serve (it cannot be seen here): no line."""
    storage = str(cfg.run.storage_path)
    if "://" not in storage or storage.startswith("file://"):
        return
    if run_env & set(CREDENTIAL_ENV) or set(cfg.env) & set(CREDENTIAL_ENV):
        return  # the runtime env or the config's env gives every process its credentials
    external = declared_external(objects)[0]
    seen = {g.path: identity(g, objects, namespace, external) for g in groups}
    having = [(g, who) for g in groups if (who := seen[g.path])]
    if not having:
        return
    first, who = having[0]
    for g in groups:
        if seen[g.path] != "":
            continue  # has one, or names an account that is not there (ref.service-account says so)
        account = g.pod.get("serviceAccountName") or g.pod.get("serviceAccount")
        now = f"{account!r}, which has no role annotation" if account else "not set (the namespace's 'default' account)"
        yield (
            f"{g.path}.template.spec.serviceAccountName",
            "raylane.storage-identity",
            (
                f"{now}, while the {first.name} group reaches {storage.split('/')[0]}// through {who}: this "
                f"group's processes get no credentials for run.storage_path and fail at their first checkpoint"
            ),
        )


def identity(group: PodGroup, objects: list[Obj], namespace: str, external: set[tuple[str, str]]) -> str | None:
    """How the group's pods reach a bucket ("" for no way seen; None for an account that is not
    in the files, or declared external: unknown)."""
    container = group.ray_container
    names = {str(v.get("name")) for v in container.get("env") or [] if isinstance(v, dict)}
    if names & set(CREDENTIAL_ENV) or container.get("envFrom"):
        return "credentials in its environment"
    account = str(group.pod.get("serviceAccountName") or group.pod.get("serviceAccount") or "default")
    defined = [o for o in objects if o.kind == "ServiceAccount" and o.name == account]
    defined = [o for o in defined if same_namespace(o.namespace, namespace)]
    if not defined:
        return "" if account == "default" else None
    role = next((a for a in ROLE_ANNOTATIONS if defined[0].annotations.get(a)), None)
    return f"ServiceAccount {account} ({role})" if role else ""
