"""Layer 2: the KubeRay operator's own rules, which no schema holds. Ported from
`ray-operator/controllers/ray/utils/validation.go` of KubeRay v1.7.0 (commit 59d663ae; the
function names below are its), with the feature gates at their defaults. The operator applies
them when it reconciles: a RayJob that breaks one is accepted by the API server and then sits
Failed (or never starts), which `kubectl apply` does not show.

Left out: RayService and RayCronJob (not used by raylane), the history-server collector, TLS and
network-policy details behind alpha feature gates (their use alone is reported), and the rules on
the object's status."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml

from raylane.k8s.model import Obj, PodGroup, cluster_spec, env_value, get, pod_groups
from raylane.k8s.plain import DNS1035_LABEL, label_key_error, label_value_error

MAX_RAYCLUSTER_NAME = 53  # constant.go MaxRayClusterNameLength
MAX_RAYJOB_NAME = MAX_RAYCLUSTER_NAME - 6  # MaxRayJobNameLength
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
AUTOSCALER_V2_ENV = "RAY_enable_autoscaler_v2"
TOKEN_AUTH_MIN_RAY = (2, 52, 0)
K8S_TOKEN_AUTH_MIN_RAY = (2, 55, 0)
PRIORITY_MIN_RAY = (2, 56, 0)
# Alpha feature gates, off unless the operator was started with them (features.go).
GATED = {
    "networkPolicy": "RayClusterNetworkPolicy",
    "tlsOptions": "RayClusterMTLS",
    "historyServerOptions": "RayClusterHistoryServer",
}

Rule = tuple[str, str, str]  # (field path, rule id, message)


def ray_version(text: Any) -> tuple[int, ...] | None:
    """k8s.io/apimachinery's ParseGeneric: 2.60 or 2.60.0 (a leading v and a suffix allowed)."""
    found = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    return tuple(int(x or 0) for x in found.groups()) if found else None


def shown_version(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def check_operator(obj: Obj) -> list[Rule]:
    if obj.kind not in ("RayJob", "RayCluster") or not isinstance(obj.body, dict):
        return []
    out = list(check_name(obj))
    if obj.kind == "RayJob":
        out += list(check_rayjob(obj.body))
    found = cluster_spec(obj.body)
    if found:
        annotations = get(obj.body, "metadata", "annotations", default={}) or {}
        out += list(check_cluster_spec(found[0], found[1], annotations))
    return out


def check_name(obj: Obj) -> Iterator[Rule]:
    """ValidateRayJobMetadata / ValidateRayClusterMetadata: the child objects' names are built from it."""
    name = obj.name
    limit = MAX_RAYJOB_NAME if obj.kind == "RayJob" else MAX_RAYCLUSTER_NAME
    if len(name) > limit:
        yield "metadata.name", "operator.name", f"{name!r}: a {obj.kind} name may have at most {limit} characters"
    elif name and not DNS1035_LABEL.match(name):
        yield (
            "metadata.name",
            "operator.name",
            f"{name!r}: not a DNS-1035 label (lowercase letters, digits, '-'; a letter first)",
        )


def check_rayjob(body: dict[str, Any]) -> Iterator[Rule]:
    """ValidateRayJobSpec."""
    spec = body.get("spec") or {}
    shutdown = bool(spec.get("shutdownAfterJobFinishes"))
    mode = spec.get("submissionMode", "K8sJobMode")
    backoff = spec.get("backoffLimit")
    if mode not in SUBMISSION_MODES:
        yield (
            "spec.submissionMode",
            "operator.submission-mode",
            f"{mode!r} is none of {', '.join(SUBMISSION_MODES)}: the operator would never submit the job",
        )
    if spec.get("suspend") and not shutdown:
        yield (
            "spec.suspend",
            "operator.suspend-needs-shutdown",
            "a RayJob may be suspended only with shutdownAfterJobFinishes: true",
        )
    ttl = spec.get("ttlSecondsAfterFinished") or 0
    if ttl < 0:
        yield "spec.ttlSecondsAfterFinished", "operator.ttl", f"{ttl}: must not be negative"
    elif ttl > 0 and not shutdown:
        yield (
            "spec.ttlSecondsAfterFinished",
            "operator.ttl-needs-shutdown",
            f"{ttl}: a TTL needs shutdownAfterJobFinishes: true",
        )
    yield from check_deletion(spec, shutdown)
    yield from check_submission(spec, mode, backoff)
    if get(spec, "rayClusterSpec", "authOptions", "enableK8sTokenAuth"):
        yield (
            "spec.rayClusterSpec.authOptions.enableK8sTokenAuth",
            "operator.k8s-token-auth",
            "Kubernetes token auth is not supported for a RayJob (use mode: token)",
        )
    yield from check_runtime_env(spec.get("runtimeEnvYAML"))
    for key in ("activeDeadlineSeconds", "preRunningDeadlineSeconds"):
        if spec.get(key) is not None and spec[key] <= 0:
            yield f"spec.{key}", "operator.deadline", f"{spec[key]}: must be a positive number of seconds"
    if backoff is not None and backoff < 0:
        yield "spec.backoffLimit", "operator.backoff", f"{backoff}: must not be negative"


def check_submission(spec: dict[str, Any], mode: str, backoff: Any) -> Iterator[Rule]:
    """ValidateRayJobSpec's rules on where and how the job is submitted."""
    selector = spec.get("clusterSelector") or {}
    if spec.get("suspend") and selector:
        yield "spec.suspend", "operator.cluster-selector", "a RayJob with a clusterSelector cannot be suspended"
    if not spec.get("rayClusterSpec") and not selector:
        yield "spec", "operator.cluster", "one of rayClusterSpec or clusterSelector must be set"
    if selector:
        if not selector.get("ray.io/cluster"):
            yield (
                "spec.clusterSelector",
                "operator.cluster-selector",
                "must name the cluster under the key ray.io/cluster",
            )
        if mode == "SidecarMode":
            yield "spec.clusterSelector", "operator.cluster-selector", "not supported in SidecarMode"
        if backoff and backoff > 0:
            yield (
                "spec.backoffLimit",
                "operator.cluster-selector",
                f"{backoff}: retries are incompatible with a clusterSelector",
            )
    if mode == "InteractiveMode" and backoff and backoff > 0:
        yield (
            "spec.backoffLimit",
            "operator.interactive-backoff",
            f"{backoff}: retries are incompatible with InteractiveMode",
        )
    if mode == "SidecarMode":
        for key in ("submitterPodTemplate", "submitterConfig"):
            if spec.get(key) is not None:
                yield f"spec.{key}", "operator.sidecar-mode", "not supported in SidecarMode"
        policy = get(spec, "rayClusterSpec", "headGroupSpec", "template", "spec", "restartPolicy", default="")
        if policy not in ("", "Never"):
            yield (
                "spec.rayClusterSpec.headGroupSpec.template.spec.restartPolicy",
                "operator.sidecar-mode",
                f"{policy}: must be Never or unset in SidecarMode",
            )


def check_runtime_env(text: Any) -> Iterator[Rule]:
    """dashboardclient.UnmarshalRuntimeEnvYAML: the string parses as a YAML mapping."""
    if not text:
        return
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        yield "spec.runtimeEnvYAML", "operator.runtime-env", f"not valid YAML: {str(exc).splitlines()[0]}"
        return
    if parsed is not None and not isinstance(parsed, dict):
        yield "spec.runtimeEnvYAML", "operator.runtime-env", f"must be a YAML mapping, got a {type(parsed).__name__}"


def check_deletion(spec: dict[str, Any], shutdown: bool) -> Iterator[Rule]:
    """validateDeletionConfiguration (the RayJobDeletionPolicy gate is on by default in 1.7.0)."""
    strategy = spec.get("deletionStrategy")
    if not isinstance(strategy, dict):
        return
    rules = strategy.get("deletionRules") or []
    if rules and shutdown:
        yield (
            "spec.deletionStrategy.deletionRules",
            "operator.deletion-rules",
            "deletionRules and shutdownAfterJobFinishes: true are mutually exclusive",
        )
    autoscaling = bool(get(spec, "rayClusterSpec", "enableInTreeAutoscaling"))
    for i, rule in enumerate(rules):
        policy = get(rule, "policy")
        if spec.get("clusterSelector") and policy in ("DeleteCluster", "DeleteWorkers"):
            yield (
                f"spec.deletionStrategy.deletionRules[{i}].policy",
                "operator.deletion-rules",
                f"{policy}: not supported with a clusterSelector",
            )
        elif autoscaling and policy == "DeleteWorkers":
            yield (
                f"spec.deletionStrategy.deletionRules[{i}].policy",
                "operator.deletion-rules",
                "DeleteWorkers: not supported with autoscaling",
            )
    for when in ("onSuccess", "onFailure"):
        policy = get(strategy, when, "policy")
        if policy == "DeleteWorkers" and autoscaling:
            yield (
                f"spec.deletionStrategy.{when}.policy",
                "operator.deletion-rules",
                "DeleteWorkers: not supported with autoscaling",
            )
        if policy == "DeleteNone" and shutdown:
            yield (
                f"spec.deletionStrategy.{when}.policy",
                "operator.deletion-rules",
                "DeleteNone contradicts shutdownAfterJobFinishes: true",
            )


def check_cluster_spec(prefix: str, spec: dict[str, Any], annotations: dict[str, Any]) -> Iterator[Rule]:
    """ValidateRayClusterSpec."""
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    v2 = get(spec, "autoscalerOptions", "version") == "v2"
    groups = list(pod_groups(prefix, spec))
    head = next((g for g in groups if g.is_head), None)
    head_env = env_value(head.ray_container, AUTOSCALER_V2_ENV) if head else None
    v2_by_env = bool(head_env and head_env[1] in ("1", "true"))
    for group in groups:
        yield from check_group(group)
        if not group.is_head:
            yield from check_worker_group(group, spec, autoscaling, v2 or v2_by_env)
    if head and head_env and not autoscaling and v2_by_env:
        yield (
            f"{head.path}.template.spec.containers[0].env[{head_env[0]}]",
            "operator.autoscaler",
            f"{AUTOSCALER_V2_ENV}={head_env[1]} needs enableInTreeAutoscaling: true",
        )
    if autoscaling and head_env and get(spec, "autoscalerOptions", "version"):
        yield (
            f"{prefix}.autoscalerOptions.version",
            "operator.autoscaler",
            f"set together with the head's {AUTOSCALER_V2_ENV}: use only autoscalerOptions.version",
        )
    if autoscaling and v2:
        for group in groups:
            policy = group.pod.get("restartPolicy", "")
            if policy not in ("", "Never"):
                yield (
                    f"{group.path}.template.spec.restartPolicy",
                    "operator.restart-policy",
                    f"{policy}: must be Never or unset under autoscaler v2",
                )
    idle = get(spec, "autoscalerOptions", "idleTimeoutSeconds")
    if idle is not None and idle < 0:
        yield f"{prefix}.autoscalerOptions.idleTimeoutSeconds", "operator.idle-timeout", f"{idle}: must not be negative"
    yield from check_gcs_ft(prefix, spec, head, annotations)
    yield from check_auth(prefix, spec)
    for key, gate in GATED.items():
        if spec.get(key) is not None:
            yield (
                f"{prefix}.{key}",
                "operator.feature-gate",
                f"needs the operator's {gate} feature gate (alpha, off by default)",
            )


def check_group(group: PodGroup) -> Iterator[Rule]:
    """validateRayGroupResources and validateRayGroupLabels, for the head and every worker group."""
    params = group.spec.get("rayStartParams") or {}
    if not group.pod.get("containers"):
        yield f"{group.path}.template.spec.containers", "operator.containers", "needs at least one container"
    if any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.spec.get("resources"):
        yield f"{group.path}.resources", "operator.group-resources", "set in both rayStartParams and resources: use one"
    if "labels" in params:
        yield (
            f"{group.path}.rayStartParams.labels",
            "operator.group-labels",
            "not supported: use the group's labels field",
        )
    for key, value in (group.spec.get("labels") or {}).items():
        for error in (label_key_error(str(key)), label_value_error(str(key), value)):
            if error:
                yield f"{group.path}.labels.{key}", "operator.group-labels", error


def check_worker_group(group: PodGroup, spec: dict[str, Any], autoscaling: bool, v2: bool) -> Iterator[Rule]:
    low, high = group.spec.get("minReplicas"), group.spec.get("maxReplicas")
    if not autoscaling and (low is None or high is None):
        yield (
            group.path,
            "operator.min-max-replicas",
            "minReplicas and maxReplicas must both be set without autoscaling",
        )
    if low is not None and high is not None and low > high:
        yield f"{group.path}.minReplicas", "operator.min-max-replicas", f"{low}: more than maxReplicas ({high})"
    if group.spec.get("suspend") and autoscaling:
        yield (
            f"{group.path}.suspend",
            "operator.suspend-group",
            "a worker group cannot be suspended with the autoscaler on",
        )
    idle = group.spec.get("idleTimeoutSeconds")
    if idle is not None and (idle < 0 or not v2):
        why = "must not be negative" if idle < 0 else "needs autoscaler v2 (autoscalerOptions.version: v2)"
        yield f"{group.path}.idleTimeoutSeconds", "operator.idle-timeout", f"{idle}: {why}"
    priority = group.spec.get("priority")
    if priority:
        version = ray_version(spec.get("rayVersion"))
        if version is None or version < PRIORITY_MIN_RAY:
            yield (
                f"{group.path}.priority",
                "operator.priority",
                f"needs rayVersion >= {shown_version(PRIORITY_MIN_RAY)}, got {spec.get('rayVersion')!r}",
            )
        elif not v2:
            yield f"{group.path}.priority", "operator.priority", "needs autoscaler v2 (autoscalerOptions.version: v2)"


def check_gcs_ft(
    prefix: str, spec: dict[str, Any], head: PodGroup | None, annotations: dict[str, Any]
) -> Iterator[Rule]:
    """The GCS fault-tolerance rules of ValidateRayClusterSpec (redis backend)."""
    options = spec.get("gcsFaultToleranceOptions")
    container = head.ray_container if head else {}
    params = (head.spec.get("rayStartParams") or {}) if head else {}
    if annotations.get("ray.io/ft-enabled") and options is not None:
        yield (
            f"{prefix}.gcsFaultToleranceOptions",
            "operator.gcs-ft",
            "set together with the ray.io/ft-enabled annotation: use only gcsFaultToleranceOptions",
        )
    enabled = str(annotations.get("ray.io/ft-enabled", "")).lower() == "true" or options is not None
    if not enabled and env_value(container, "RAY_REDIS_ADDRESS"):
        yield (
            f"{prefix}.headGroupSpec",
            "operator.gcs-ft",
            "RAY_REDIS_ADDRESS is set but gcsFaultToleranceOptions is not",
        )
    if options is not None:
        if params.get("redis-password"):
            yield (
                f"{prefix}.headGroupSpec.rayStartParams.redis-password",
                "operator.gcs-ft",
                "use gcsFaultToleranceOptions.redisPassword",
            )
        for name in ("REDIS_PASSWORD", "RAY_REDIS_ADDRESS"):
            if env_value(container, name):
                yield (
                    f"{prefix}.headGroupSpec",
                    "operator.gcs-ft",
                    f"the head sets {name}: use gcsFaultToleranceOptions",
                )
        if get(options, "backend") == "rocksdb":
            yield (
                f"{prefix}.gcsFaultToleranceOptions.backend",
                "operator.feature-gate",
                "rocksdb needs the GCSFaultToleranceEmbeddedStorage feature gate (alpha, off by default)",
            )
    if params.get("redis-username") or env_value(container, "REDIS_USERNAME"):
        yield (
            f"{prefix}.headGroupSpec",
            "operator.gcs-ft",
            "a redis username goes in gcsFaultToleranceOptions.redisUsername",
        )


def check_auth(prefix: str, spec: dict[str, Any]) -> Iterator[Rule]:
    auth = spec.get("authOptions") or {}
    k8s_auth = bool(auth.get("enableK8sTokenAuth"))
    if auth.get("mode") != "token":
        if k8s_auth:
            yield f"{prefix}.authOptions.enableK8sTokenAuth", "operator.token-auth", "needs authOptions.mode: token"
        return
    version = ray_version(spec.get("rayVersion"))
    if version is None or version < TOKEN_AUTH_MIN_RAY:
        yield (
            f"{prefix}.rayVersion",
            "operator.token-auth",
            f"{spec.get('rayVersion')!r}: token auth (authOptions.mode: token) needs Ray >= {shown_version(TOKEN_AUTH_MIN_RAY)}",
        )
    elif k8s_auth and version < K8S_TOKEN_AUTH_MIN_RAY:
        yield (
            f"{prefix}.rayVersion",
            "operator.token-auth",
            f"{spec.get('rayVersion')!r}: enableK8sTokenAuth needs Ray >= {shown_version(K8S_TOKEN_AUTH_MIN_RAY)}",
        )
    if k8s_auth and auth.get("secretName"):
        yield f"{prefix}.authOptions.secretName", "operator.token-auth", "not allowed together with enableK8sTokenAuth"
