"""Layer 3, second half: whether the cluster a RayJob or RayCluster describes can run raylane the
way the config asks, and survive a spot reclaim.

- Checkpoints on storage every pod reaches (`run.storage_path` with `://`, or under a volume every
  Ray pod mounts), and a fixed `run.name` so that a RayJob retry (a new cluster) resumes.
- No more GPUs than the worker groups can ever hold (maxReplicas x GPUs per pod).
- MLflow reached over http(s) by a host the MLflow server of the same files allows: MLflow 3
  answers 403 to any other Host header (localhost and private IPs only by default; `--allowed-hosts`
  compares host:port as sent, port included), and raylane would then train untracked.
- One Ray version everywhere: rayVersion equals the Ray installed here (raylane's pin), and every
  Ray image's tag names it (or the image is pinned by digest).
- Preemption: KubeRay's pod deletion reaches `ray start` as SIGTERM; Ray marks the node draining
  for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (default 30 s; 0 turns draining off), Ray Train's
  watcher (off with RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0) polls for it every
  RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S (5 s), and raylane's ranks act on it whatever
  failure.max_failures says (raylane.onray.runtime). The pod must outlive the drain window:
  terminationGracePeriodSeconds (Kubernetes' default 30 s) above the drain timeout."""

from __future__ import annotations

import fnmatch
import functools
import ipaddress
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any
from urllib.parse import urlparse

from raylane.config import BaseConfig
from raylane.config.workerenv import references
from raylane.k8s.groups import ray_resources
from raylane.k8s.model import Obj, PodGroup, env_value, get
from raylane.k8s.operator import ray_version

Rule = tuple[str, str, str]
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
DRAIN_DEFAULT_S = 30.0  # Ray 2.60 default of RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (its ray_constants module)
POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"
POLL_DEFAULT_S = 5.0  # Ray Train V2 default of RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S (its constants module)
WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
RAYLANE_DRAIN_POLL_S = 0.5  # raylane.onray.runtime.DRAIN_POLL_S (that module imports Ray)
GRACE_DEFAULT_S = 30  # Kubernetes' terminationGracePeriodSeconds
# MLflow 3's defaults when no --allowed-hosts is given (mlflow.server.security_utils).
MLFLOW_DEFAULT_HOSTS = ["localhost", "127.0.0.1", "[::1]", "0.0.0.0"]
SHARED_VOLUMES = ("persistentVolumeClaim", "nfs", "csi", "cephfs", "glusterfs", "azureFile")


@functools.cache
def installed_ray() -> str | None:
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return None


def number(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def gpus_per_pod(group: PodGroup) -> float:
    return ray_resources(group).get("GPU", 0.0)


def cpus_per_pod(group: PodGroup) -> float | None:
    return ray_resources(group).get("CPU")


def check_run(cfg: BaseConfig, groups: list[PodGroup] | None, env: dict[str, str | None]) -> Iterator[Rule]:
    """What the config asks of the cluster, for a RayJob that runs raylane (`groups` None: a
    cluster not in these files, whose pods and environment are not known)."""
    storage = str(cfg.run.storage_path)
    if "://" not in storage and not shared_mount(storage, groups or []):
        yield (
            "spec.entrypoint",
            "raylane.storage-path",
            (
                f"run.storage_path = {storage!r}: not shared storage; a pod's own disk goes with the pod and a "
                "retry (a new cluster) starts from scratch: use s3://, gs:// or a volume every Ray pod mounts"
            ),
        )
    if not cfg.run.name:
        yield (
            "spec.entrypoint",
            "raylane.run-name",
            ("run.name is not set: each RayJob retry would start a new run instead of resuming (--set run.name=...)"),
        )
    if groups is None:
        return
    yield from check_workers(cfg, [g for g in groups if not g.is_head])
    yield from check_placement(cfg, [g for g in groups if not g.is_head])
    for key, name in references(cfg.env).items():
        if name not in env:
            yield (
                "spec.entrypoint",
                "raylane.env-reference",
                (
                    f"env.{key} reads ${{{name}}} from the driver's environment, which neither runtimeEnvYAML's "
                    "env_vars nor the head container sets"
                ),
            )


def check_workers(cfg: BaseConfig, workers: list[PodGroup]) -> Iterator[Rule]:
    sc = cfg.scaling
    capacity = sum(gpus_per_pod(g) * int(g.spec.get("maxReplicas") or 0) for g in workers)
    if sc.use_gpu:
        asked = sc.num_workers * sc.gpus_per_worker
        if asked > capacity:
            yield (
                "spec.entrypoint",
                "raylane.gpus",
                (
                    f"scaling.num_workers = {sc.num_workers} x gpus_per_worker {sc.gpus_per_worker:g} = {asked:g} GPUs, "
                    f"more than the worker groups can ever hold ({capacity:g}: maxReplicas x GPUs per pod)"
                ),
            )
    elif capacity:
        yield (
            "spec.entrypoint",
            "raylane.gpus",
            (f"scaling.use_gpu is false but the worker groups hold {capacity:g} GPUs: set scaling.use_gpu=true"),
        )
    for g in workers:
        gpus, cpus = gpus_per_pod(g), cpus_per_pod(g)
        if not (sc.use_gpu and gpus and cpus is not None and sc.gpus_per_worker):
            continue
        need = int(gpus // sc.gpus_per_worker) * sc.cpus_per_worker
        if need > cpus:
            yield (
                f"{g.path}.template.spec.containers[0].resources",
                "raylane.cpus",
                (
                    f"{gpus:g} GPUs make {int(gpus // sc.gpus_per_worker)} workers of {sc.cpus_per_worker:g} CPUs, "
                    f"{need:g} CPUs in all, but the pod offers Ray {cpus:g}"
                ),
            )


def check_placement(cfg: BaseConfig, workers: list[PodGroup]) -> Iterator[Rule]:
    """Every worker asks for resources, an accelerator type and labels that some worker group
    offers, as the autoscaler sees the groups (raylane.k8s.groups): else, with the groups at 0,
    no node is ever started for the workers and the run waits for them forever."""
    sc = cfg.scaling
    offered = [(g, ray_resources(g)) for g in workers if int(g.spec.get("maxReplicas") or 0) > 0]
    for name, amount in sc.resources_per_worker.items():
        if not any(have.get(name, 0.0) >= amount for _, have in offered):
            yield (
                "spec.entrypoint",
                "raylane.placement",
                (
                    f"scaling.resources_per_worker.{name} = {amount:g}: no worker group offers {amount:g} {name} (its "
                    "`resources` field or rayStartParams resources), so the autoscaler never starts a node for the workers"
                ),
            )
    if sc.accelerator_type:
        wanted = f"accelerator_type:{sc.accelerator_type}"
        running = any(int(g.spec.get("minReplicas") or 0) > 0 and have.get("GPU") for g, have in offered)
        if not running and not any(wanted in have for _, have in offered):
            yield (
                "spec.entrypoint",
                "raylane.placement",
                (
                    f"scaling.accelerator_type = {sc.accelerator_type!r}: no worker group declares {wanted} in its "
                    f'`resources` (e.g. {{"{wanted}": "1"}}); Ray detects the type only on a running node, so the '
                    "autoscaler never starts one for the workers"
                ),
            )
    for key, value in sc.label_selector.items():
        if key.startswith("ray.io/") or any(c in value for c in "!(,"):
            continue  # Ray's own labels, and expressions: not known before the node runs
        if not any((g.spec.get("labels") or {}).get(key) == value for g, _ in offered):
            yield (
                "spec.entrypoint",
                "raylane.placement",
                (
                    f"scaling.label_selector.{key} = {value!r}: no worker group has the label {key}={value} "
                    "(its `labels` field), so the autoscaler never starts a node for the workers"
                ),
            )


def shared_mount(path: str, groups: list[PodGroup]) -> bool:
    """Every Ray pod mounts a shared volume (a claim, NFS, CSI...) at or above `path`."""

    def mounts(g: PodGroup) -> bool:
        volumes = {v.get("name"): v for v in g.pod.get("volumes") or [] if isinstance(v, dict)}
        for m in g.ray_container.get("volumeMounts") or []:
            volume = volumes.get(m.get("name")) or {}
            base = str(m.get("mountPath", "")).rstrip("/") + "/"
            if (path.rstrip("/") + "/").startswith(base) and any(k in volume for k in SHARED_VOLUMES):
                return True
        return False

    return path.startswith("/") and bool(groups) and all(mounts(g) for g in groups)


def check_versions(prefix: str, spec: dict[str, Any], groups: list[PodGroup]) -> Iterator[Rule]:
    """rayVersion is the Ray installed here, and every Ray image's tag names it."""
    wanted, here = spec.get("rayVersion"), installed_ray()
    if not wanted:
        yield f"{prefix}.rayVersion", "raylane.ray-version", f"not set: write the Ray version the image holds ({here})"
    elif here and ray_version(wanted) != ray_version(here):
        yield (
            f"{prefix}.rayVersion",
            "raylane.ray-version",
            (f"{wanted!r}: raylane here runs Ray {here}; the image, rayVersion and the client's Ray must agree"),
        )
    version = str(wanted or here or "")
    for g in groups:
        image = str(g.ray_container.get("image") or "")
        if "@sha256:" in image:
            continue
        tail = image.rsplit("/", 1)[-1]
        tag = tail.split(":", 1)[1] if ":" in tail else ""
        if not version or version not in tag:
            yield (
                f"{g.path}.template.spec.containers[0].image",
                "raylane.image-tag",
                (
                    f"{image!r}: its tag does not name Ray {version}; tag images with the Ray version they hold "
                    "(e.g. raylane:0.1.0-ray{version}) or pin them by @sha256 digest".replace("{version}", version)
                ),
            )


def hosts_ranks(group: PodGroup) -> bool:
    """The head can run training workers: it offers Ray CPUs or GPUs (raylane's heads say num-cpus 0)."""
    cpus = cpus_per_pod(group)
    return gpus_per_pod(group) > 0 or cpus is None or cpus > 0


def check_preemption(groups: list[PodGroup], env: dict[str, str | None]) -> Iterator[Rule]:
    """A worker pod's deletion becomes Ray's drain notice in time, and the pod outlives the drain."""
    watcher = env.get(WATCHER_ENV)
    if watcher is not None and watcher.strip().lower() in ("0", "false", "no", "off"):
        yield (
            "spec",
            "raylane.preemption",
            (
                f"{WATCHER_ENV}={watcher}: Ray Train's preemption watcher is off, so no drain notice reaches the "
                "ranks and a spot reclaim loses every step since the last checkpoint"
            ),
        )
    poll = number(env.get(POLL_ENV)) or POLL_DEFAULT_S
    for g in groups:
        if g.is_head and not hosts_ranks(g):  # its deletion ends the cluster whatever the window
            continue
        found = env_value(g.ray_container, DRAIN_ENV)
        drain = DRAIN_DEFAULT_S if found is None else number(found[1])
        if drain is None:  # from a Secret or not a number: Ray's own parse decides
            continue
        grace = g.pod.get("terminationGracePeriodSeconds", GRACE_DEFAULT_S)
        where = f"{g.path}.template.spec"
        if drain <= 0:
            yield (
                f"{where}.containers[0].env",
                "raylane.preemption",
                (
                    f"{DRAIN_ENV}={found[1] if found else ''}: draining is off, so a deleted pod's ranks get no "
                    "notice and the steps since the last checkpoint are lost"
                ),
            )
        elif poll + RAYLANE_DRAIN_POLL_S >= drain:
            yield (
                f"{where}.containers[0].env",
                "raylane.preemption",
                (
                    f"{DRAIN_ENV}={drain:g}: the drain notice reaches the ranks up to {poll + RAYLANE_DRAIN_POLL_S:g} s "
                    f"after SIGTERM ({POLL_ENV}={poll:g} + raylane's {RAYLANE_DRAIN_POLL_S:g}), after the window closes"
                ),
            )
        elif grace <= drain:
            shown = "" if "terminationGracePeriodSeconds" in g.pod else " (Kubernetes' default)"
            yield (
                f"{where}.terminationGracePeriodSeconds",
                "raylane.grace-period",
                (
                    f"{grace}{shown}: not above the drain window {DRAIN_ENV}={drain:g}; the pod is killed before the "
                    f"ranks' checkpoint is safe (group {g.name})"
                ),
            )


# -- MLflow --------------------------------------------------------------------------------------------


@dataclass
class MlflowServer:
    obj: Obj
    allowed: list[str]  # the Host headers it accepts (patterns with *)
    labels: dict[str, Any]  # its pods' labels


def mlflow_servers(objects: list[Obj]) -> list[MlflowServer]:
    """Every Deployment (or StatefulSet, Pod) of the set that runs `mlflow server`."""
    out = []
    for obj in objects:
        if obj.kind not in ("Deployment", "StatefulSet", "Pod") or not isinstance(obj.body, dict):
            continue
        pod = obj.body.get("spec") if obj.kind == "Pod" else get(obj.body, "spec", "template", "spec")
        labels = (
            get(obj.body, "metadata", "labels")
            if obj.kind == "Pod"
            else get(obj.body, "spec", "template", "metadata", "labels")
        )
        for c in get(pod, "containers", default=[]) or []:
            words = [str(w) for w in (c.get("command") or []) + (c.get("args") or [])]
            if len(words) >= 2 and words[-1].count(" ") and words[-2] in ("-c", "-ec", "-ce"):
                words = words[:-1] + shlex.split(words[-1])  # sh -c "mlflow server ..."
            if "mlflow" in words and "server" in words[words.index("mlflow") :]:
                out.append(MlflowServer(obj, allowed_hosts(words, c), labels or {}))
    return out


def allowed_hosts(words: list[str], container: dict[str, Any]) -> list[str]:
    for i, word in enumerate(words):
        if word == "--allowed-hosts" and i + 1 < len(words):
            return [h.strip() for h in words[i + 1].split(",")]
        if word.startswith("--allowed-hosts="):
            return [h.strip() for h in word.split("=", 1)[1].split(",")]
    found = env_value(container, "MLFLOW_SERVER_ALLOWED_HOSTS")
    if found and found[1]:
        return [h.strip() for h in found[1].split(",")]
    return MLFLOW_DEFAULT_HOSTS + [f"{h}:*" for h in MLFLOW_DEFAULT_HOSTS] + ["private IP addresses"]


def host_allowed(allowed: list[str], host: str) -> bool:
    """mlflow.server.security_utils.is_allowed_host_header, and its private-IP defaults."""
    if "private IP addresses" in allowed:
        try:
            if ipaddress.ip_address(host.rsplit(":", 1)[0].strip("[]")).is_private:
                return True
        except ValueError:
            pass
    if "*" in allowed:
        return True
    return any(fnmatch.fnmatch(host, a) if "*" in a else host == a for a in allowed)


def check_mlflow(uri: str | None, path: str, objects: list[Obj]) -> Iterator[Rule]:
    """The tracking URI is http(s), allowed by the MLflow server of the set, through its Service."""
    if uri is None:
        return
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        yield (
            path,
            "raylane.mlflow-uri",
            (
                f"MLFLOW_TRACKING_URI = {uri!r}: not an http(s) server; a file or sqlite store on the head is "
                "deleted with the cluster. Point it at the MLflow server (http://mlflow.<namespace>.svc.cluster.local:5000)"
            ),
        )
        return
    servers = mlflow_servers(objects)
    if not servers:
        return  # MLflow runs elsewhere: nothing here to compare with
    if not any(host_allowed(s.allowed, parsed.netloc) for s in servers):
        allowed = ", ".join(servers[0].allowed)
        yield (
            path,
            "raylane.mlflow-host",
            (
                f"MLFLOW_TRACKING_URI = {uri!r}: Host {parsed.netloc!r} is not in the MLflow server's allowed hosts "
                f"({allowed}; {servers[0].obj.label}); MLflow 3 answers 403 and the run trains untracked. "
                f"Add {parsed.netloc} to its --allowed-hosts (the port is part of the host)"
            ),
        )
    service = parsed.hostname.split(".")[0]
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        ipaddress.ip_address(parsed.hostname)
        return  # an address, not a Service name
    except ValueError:
        pass
    known = {o.name: o for o in objects if o.kind == "Service"}
    svc = known.get(service)
    if svc is None:
        yield (
            path,
            "raylane.mlflow-service",
            (f"MLFLOW_TRACKING_URI = {uri!r}: no Service {service!r} in these files, beside the MLflow server"),
        )
    elif port not in [p.get("port") for p in get(svc.body, "spec", "ports", default=[]) or []]:
        yield path, "raylane.mlflow-service", f"MLFLOW_TRACKING_URI = {uri!r}: Service {service!r} has no port {port}"
