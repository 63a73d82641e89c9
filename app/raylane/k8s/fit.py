"""Layer 3, second half: whether the cluster a RayJob or RayCluster describes can run raylane the
way the config asks, and survive a spot reclaim.

- Checkpoints on storage every pod reaches (`run.storage_path` with `://`, or under a volume every
  Ray pod mounts), and a fixed `run.name` so that a RayJob retry (a new cluster) resumes.
- No more GPUs than the worker groups can ever hold (maxReplicas x GPUs per pod).
- Every worker asks for what some worker group offers, as the autoscaler reads the groups.
- `${NAME}` in the config's env: is set in the driver's environment.

The rest of layer 3: MLflow (raylane.k8s.mlflow), one Ray version (raylane.k8s.versions), the
drain window (raylane.k8s.preemption), the pods' identity for a bucket (raylane.k8s.refs)."""

from __future__ import annotations

from collections.abc import Iterator

from raylane.config import BaseConfig
from raylane.config.workerenv import references
from raylane.k8s.groups import cpus_per_pod, gpus_per_pod, ray_resources
from raylane.k8s.model import PodGroup

Rule = tuple[str, str, str]
SHARED_VOLUMES = ("persistentVolumeClaim", "nfs", "csi", "cephfs", "glusterfs", "azureFile")


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
