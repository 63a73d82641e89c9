"""`raylane k8s check` and `raylane k8s init`: every layer over every object of the named files."""

from __future__ import annotations

import re
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from raylane.errors import ConfigError
from raylane.k8s import dockerfile, fit, mlflow, operator, pods, preemption, refs, schema, versions
from raylane.k8s.entrypoint import ParserFactory, driver_env, read_entrypoint, runtime_env
from raylane.k8s.inputs import ObjectSet, gather, shown
from raylane.k8s.model import Finding, Obj, PodGroup, cluster_spec, get, pod_groups

Rule = tuple[str, str, str]
PLACEHOLDER = re.compile(r"CHANGE[-_]?ME", re.IGNORECASE)  # what the kit asks to be filled in

MANIFESTS = Path(__file__).resolve().parent / "kuberay"  # the shipped manifests (package data)


@dataclass
class Report:
    """What a check found: every broken rule, how many objects were checked, and the kinds that
    no layer covers (counted, not failed: a NetworkPolicy beside the manifests is fine)."""

    findings: list[Finding] = field(default_factory=list)
    checked: int = 0
    unchecked: Counter[str] = field(default_factory=Counter)
    not_raylane: int = 0

    def summary(self) -> str:
        extra = []
        if self.unchecked:
            extra.append("not checked: " + ", ".join(f"{n} {k}" for k, n in sorted(self.unchecked.items())))
        if self.not_raylane:
            extra.append(f"{self.not_raylane} RayJob(s) not running raylane: their entrypoint checks skipped")
        tail = f" ({'; '.join(extra)})" if extra else ""
        return (
            f"all {self.checked} objects pass (KubeRay {schema.KUBERAY_VERSION}, Ray {versions.installed_ray()}){tail}"
        )


def check_paths(paths: list[str], parser: ParserFactory) -> Report:
    """Every layer over the objects of `paths` (files and folders); ConfigError for input that
    cannot be read at all (a missing file, bad YAML, kustomize failing). `parser`: raylane's
    argument parser (raylane.cli.parser), which the entrypoint's command line must pass."""
    report = Report()
    sets = gather(paths)
    versions_named: set[str] = set()
    for one in sets:
        check_set(one, parser, report)
        versions_named |= {v for o in one.objects if (v := ray_version_of(o))}
    dockerfiles = sets[0].dockerfiles if sets else []
    here = versions.installed_ray() or min(versions_named, default="")
    for path in dockerfiles:
        report.findings += dockerfile.check_dockerfile(path, shown(path), here)
    if not report.checked and not report.findings and not dockerfiles:
        raise ConfigError(f"{', '.join(paths)}: no Kubernetes object or Dockerfile that raylane checks")
    report.findings = merged(report.findings)
    return report


def merged(findings: list[Finding]) -> list[Finding]:
    """One line per key (a wrong Ray version wherever it is written) or per rule and message (the
    same object rendered through several overlays, one Secret missing for every group), naming
    the first place and counting the others."""
    same: dict[Any, list[Finding]] = {}
    for f in dict.fromkeys(findings):  # two pip installs of one RUN: one line
        same.setdefault(f.key or (f.rule, f.message), []).append(f)
    out = []
    for first, *others in same.values():
        if others:
            where = list(dict.fromkeys(place(o, first) for o in others))
            shown_where = ", ".join(where[:3]) + (", ..." if len(where) > 3 else "")
            plural = "s" if len(others) > 1 else ""
            first = replace(first, message=f"{first.message} (and {len(others)} more place{plural}: {shown_where})")
        out.append(first)
    return out


def place(other: Finding, first: Finding) -> str:
    """Where another finding of a merged line is: its object, or for the same object rendered
    through another kustomization, that kustomization."""
    if other.obj != first.obj:
        return other.obj
    via = other.source.partition(" via ")[2]
    return f"via {via}" if via and via != first.source.partition(" via ")[2] else other.obj


def ray_version_of(obj: Obj) -> str:
    """The rayVersion a RayJob or RayCluster names, "" for other objects."""
    found = cluster_spec(obj.body)
    return str(found[1].get("rayVersion") or "") if found else ""


def check_set(one: ObjectSet, parser: ParserFactory, report: Report) -> None:
    """The schema layer over every object first, so that the later layers can read any object of
    the set (the Service a RayJob's tracking URI names, a Secret a pod reads) as stored."""
    checked: list[Obj] = []
    for obj in one.objects:
        if isinstance(obj.raw, dict) and not obj.kind and not obj.api_version:
            report.unchecked["non-Kubernetes YAML"] += 1  # e.g. a raylane config beside the manifests
            continue
        if schema.check_object(obj):
            report.checked += 1
            checked.append(obj)
        else:
            report.unchecked[obj.kind or "object"] += 1
    external, misdeclared = refs.declared_external(one.objects)
    for obj, entry in misdeclared:
        message = f"{entry!r}: not Kind/name with Kind one of {', '.join(refs.RULES)}"
        obj.findings.append(obj.finding(f"metadata.annotations.{refs.EXTERNAL}", "ref.external", message))
    for obj in checked:
        if obj.findings:
            continue  # the later layers read the body the schema layer vouched for
        try:
            later_layers(obj, one.objects, external, parser, report)
        except Exception as exc:  # noqa: BLE001 - a case the checker did not foresee: one line, not a traceback
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            obj.findings.append(
                obj.finding("", "check.internal", f"the checker failed here: {type(exc).__name__}: {first}")
            )
    for obj in one.objects:
        obj.findings += [obj.finding(path, "raylane.placeholder", message) for path, message in placeholders(obj.raw)]
        report.findings += obj.findings


def later_layers(
    obj: Obj, objects: list[Obj], external: set[tuple[str, str]], parser: ParserFactory, report: Report
) -> None:
    rules = operator.check_operator(obj)
    rules += pods.check_resources(obj.body)
    rules += refs.check_references(obj, objects, external)
    for path, rule, message in rules:
        obj.findings.append(obj.finding(path, rule, message))
    check_raylane_side(obj, objects, parser, report)


def placeholders(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(field, message) for every string of the object that still holds the kit's CHANGE-ME."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from placeholders(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from placeholders(v, f"{path}[{i}]")
    elif isinstance(node, str) and PLACEHOLDER.search(node):
        words = [w for w in node.split() if PLACEHOLDER.search(w)]
        shown_words = " ".join(words) if len(node) > 80 else node
        yield path, f"{shown_words!r}: a placeholder of the kit (CHANGE-ME): write your own value here"


def check_raylane_side(obj: Obj, objects: list[Obj], parser: ParserFactory, report: Report) -> None:
    """Layer 3 for a RayJob or RayCluster."""
    if obj.kind not in ("RayJob", "RayCluster"):
        return
    found = cluster_spec(obj.body)
    groups = list(pod_groups(*found)) if found else []
    rules = check_job(obj, objects, parser, report) if obj.kind == "RayJob" else []
    if found:
        rules += list(preemption.check_preemption(groups, driver_env(obj.body), obj.annotations))
    where = "spec.runtimeEnvYAML"
    if "MLFLOW_TRACKING_URI" not in ((runtime_env(obj.body.get("spec") or {}) or {}).get("env_vars") or {}):
        where = f"{found[0] if found else 'spec'}.headGroupSpec.template.spec.containers[0].env"
    rules += list(mlflow.check_mlflow(driver_env(obj.body).get("MLFLOW_TRACKING_URI"), where, obj, objects))
    for path, rule, message in rules:
        obj.findings.append(obj.finding(path, rule, message))
    if found:
        for path, rule, message, key in versions.check_versions(found[0], found[1], groups):
            obj.findings.append(obj.finding(path, rule, message, key))


def check_job(obj: Obj, objects: list[Obj], parser: ParserFactory, report: Report) -> list[Rule]:
    """A RayJob's entrypoint, its config, and what the config asks of the job's cluster: its own
    (rayClusterSpec), or the RayCluster of these files its clusterSelector names (when it is
    elsewhere, what depends on the cluster is not checked)."""
    job = read_entrypoint(obj.body, parser, obj.folder)
    if job is not None and not job.is_raylane:
        report.not_raylane += 1
    if job is None or not job.is_raylane:
        return []
    rules = list(job.rules)
    if job.cfg is None:
        return rules
    found, env = cluster_spec(obj.body), driver_env(obj.body)
    groups: list[PodGroup] | None = list(pod_groups(*found)) if found else None
    name = get(obj.body, "spec", "clusterSelector", "ray.io/cluster")
    target = next((o for o in objects if o.kind == "RayCluster" and name and o.name == name), None)
    if groups is None and target is not None and (selected := cluster_spec(target.seen)):
        groups, env = list(pod_groups(*selected)), {**driver_env(target.seen), **env}
    rules += list(fit.check_run(job.cfg, groups, env))
    if groups is not None:
        run_env = set((runtime_env(obj.body.get("spec") or {}) or {}).get("env_vars") or {})
        namespace = target.namespace if found is None and target is not None else obj.namespace
        rules += list(refs.check_storage_identity(job.cfg, groups, objects, namespace, run_env))
    # Unknown where the cluster is elsewhere, or where runtimeEnvYAML does not parse (the operator's line says so).
    env_known = groups is not None and runtime_env(obj.body.get("spec") or {}) is not None
    if job.cfg.mlflow.enabled and "MLFLOW_TRACKING_URI" not in env and env_known:
        message = (
            "no MLFLOW_TRACKING_URI in runtimeEnvYAML's env_vars or the head's env: the run would record into the "
            "head's local store, deleted with the cluster (or set mlflow.enabled=false)"
        )
        rules.append(("spec.runtimeEnvYAML", "raylane.mlflow-uri", message))
    return rules


def init(folder: str, source: Path = MANIFESTS) -> list[Path]:
    """Copies the shipped manifests into `folder` (made if missing); ConfigError, before writing
    anything, when one of the files is there already. Returns the files written."""
    if not source.is_dir() or not any(p.is_file() for p in source.rglob("*")):
        raise ConfigError(f"k8s init: this install has no shipped manifests ({source} is missing or empty)")
    target = Path(folder)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"k8s init: {folder} is a file, not a folder")
    files = sorted(p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    clash = [target / p.relative_to(source) for p in files if (target / p.relative_to(source)).exists()]
    if clash:
        more = f" and {len(clash) - 1} more" if len(clash) > 1 else ""
        raise ConfigError(f"k8s init: {shown(clash[0])} exists{more}; nothing was written (choose an empty folder)")
    written = []
    for p in files:
        dest = target / p.relative_to(source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, dest)
        written.append(dest)
    return written
