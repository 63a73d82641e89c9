"""`raylane k8s check` and `raylane k8s init`: every layer over every object of the named files."""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from raylane.errors import ConfigError
from raylane.k8s import dockerfile, fit, operator, schema
from raylane.k8s.entrypoint import ParserFactory, driver_env, read_entrypoint, runtime_env
from raylane.k8s.inputs import ObjectSet, gather, shown
from raylane.k8s.model import Finding, Obj, PodGroup, cluster_spec, get, pod_groups

Rule = tuple[str, str, str]

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
        return f"all {self.checked} objects pass (KubeRay {schema.KUBERAY_VERSION}, Ray {fit.installed_ray()}){tail}"


def check_paths(paths: list[str], parser: ParserFactory) -> Report:
    """Every layer over the objects of `paths` (files and folders); ConfigError for input that
    cannot be read at all (a missing file, bad YAML, kustomize failing). `parser`: raylane's
    argument parser (raylane.cli.parser), which the entrypoint's command line must pass."""
    report = Report()
    sets = gather(paths)
    versions: set[str] = set()
    for one in sets:
        check_set(one, parser, report)
        versions |= {v for o in one.objects if (v := ray_version_of(o))}
    dockerfiles = sets[0].dockerfiles if sets else []
    for path in dockerfiles:
        report.findings += dockerfile.check_dockerfile(path, shown(path), versions or {str(fit.installed_ray())})
    if not report.checked and not report.findings and not dockerfiles:
        raise ConfigError(f"{', '.join(paths)}: no Kubernetes object or Dockerfile that raylane checks")
    return report


def ray_version_of(obj: Obj) -> str:
    """The rayVersion a RayJob or RayCluster names, "" for other objects."""
    found = cluster_spec(obj.body)
    return str(found[1].get("rayVersion") or "") if found else ""


def check_set(one: ObjectSet, parser: ParserFactory, report: Report) -> None:
    for obj in one.objects:
        if isinstance(obj.raw, dict) and not obj.kind and not obj.api_version:
            report.unchecked["non-Kubernetes YAML"] += 1  # e.g. a raylane config beside the manifests
            continue
        if not schema.check_object(obj):
            report.unchecked[obj.kind or "object"] += 1
            continue
        report.checked += 1
        if not obj.findings:  # the later layers read the body the schema layer vouched for
            try:
                for path, rule, message in operator.check_operator(obj):
                    obj.findings.append(obj.finding(path, rule, message))
                check_raylane_side(obj, one.objects, parser, report)
            except Exception as exc:  # noqa: BLE001 - a case the checker did not foresee: one line, not a traceback
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                obj.findings.append(
                    obj.finding("", "check.internal", f"the checker failed here: {type(exc).__name__}: {first}")
                )
        report.findings += obj.findings


def check_raylane_side(obj: Obj, objects: list[Obj], parser: ParserFactory, report: Report) -> None:
    """Layer 3 for a RayJob or RayCluster."""
    if obj.kind not in ("RayJob", "RayCluster"):
        return
    found = cluster_spec(obj.body)
    groups = list(pod_groups(*found)) if found else []
    rules = check_job(obj, objects, parser, report) if obj.kind == "RayJob" else []
    if found:
        rules += list(fit.check_versions(found[0], found[1], groups))
        rules += list(fit.check_preemption(groups, driver_env(obj.body)))
    where = "spec.runtimeEnvYAML"
    if "MLFLOW_TRACKING_URI" not in ((runtime_env(obj.body.get("spec") or {}) or {}).get("env_vars") or {}):
        where = f"{found[0] if found else 'spec'}.headGroupSpec.template.spec.containers[0].env"
    rules += list(fit.check_mlflow(driver_env(obj.body).get("MLFLOW_TRACKING_URI"), where, objects))
    for path, rule, message in rules:
        obj.findings.append(obj.finding(path, rule, message))


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
    if groups is None and target is not None and (selected := cluster_spec(target.body)):
        groups, env = list(pod_groups(*selected)), {**driver_env(target.body), **env}
    rules += list(fit.check_run(job.cfg, groups, env))
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
