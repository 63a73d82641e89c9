"""Layer 3, preemption: a Ray pod's deletion (a spot reclaim, a scale-down, a suspended RayJob)
reaches the ranks as Ray's drain notice in time for a checkpoint, and the pod lives that long.

KubeRay's pod deletion reaches `ray start` as SIGTERM; Ray marks the node draining for
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (default 30 s; 0 turns draining off), Ray Train's watcher
(off with RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0) polls for it every
RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S (5 s), and raylane's ranks act on it within 0.5 s, whatever
failure.max_failures says (raylane.onray.runtime). What the window must hold, in order:

- the notice (poll + 0.5 s), then at least CHECKPOINT_MIN_S for the step in flight and the
  checkpoint: less and the notice comes but no checkpoint commits;
- inside the pod's terminationGracePeriodSeconds (Kubernetes' default 30 s), after which the
  kubelet kills it;
- and on spot capacity, inside what the platform gives, whatever the pod asks: GKE Spot and
  preemptible VMs give a pod 15 s from SIGTERM (the node's graceful shutdown); EC2 gives 2
  minutes' notice, of which Karpenter's interruption handling (or the Node Termination Handler)
  takes a few seconds to turn into a pod deletion: 110 s for the pod. A platform that gives more
  (GKE's longer window on newer Standard node pools) is declared with the annotation
  `raylane.io/spot-window-s` on the RayJob or RayCluster."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from raylane.k8s.groups import cpus_per_pod, gpus_per_pod
from raylane.k8s.model import PodGroup, env_value, get

Rule = tuple[str, str, str]
DRAIN_ENV = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
DRAIN_DEFAULT_S = 30.0  # Ray 2.60 default of RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S (its ray_constants module)
POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"
POLL_DEFAULT_S = 5.0  # Ray Train V2 default of RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S (its constants module)
WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
RAYLANE_DRAIN_POLL_S = 0.5  # raylane.onray.runtime.DRAIN_POLL_S (that module imports Ray)
GRACE_DEFAULT_S = 30  # Kubernetes' terminationGracePeriodSeconds
# The least the drain leaves after the notice: the step in flight, the vote on the step to stop at
# (one step boundary), and an async checkpoint of a small model to a bucket (a few seconds from a
# node). A larger model needs more: measure one save of yours and leave that.
CHECKPOINT_MIN_S = 5.0
SPOT_WINDOW_ANNOTATION = "raylane.io/spot-window-s"
# (node label, value, seconds a pod gets from SIGTERM to its kill, the platform, its overlay)
SPOT_LABELS = (
    ("cloud.google.com/gke-spot", "true", 15, "GKE Spot VMs give", "gke-spot"),
    ("cloud.google.com/gke-preemptible", "true", 15, "GKE preemptible VMs give", "gke-spot"),
    ("karpenter.sh/capacity-type", "spot", 110, "EC2 Spot gives", "aws-karpenter"),
    ("eks.amazonaws.com/capacityType", "SPOT", 110, "EC2 Spot gives", "aws-karpenter"),
)
KIT_WINDOWS = {"gke-spot": (15, 12), "aws-karpenter": (110, 90)}  # the kit's overlays: (grace, drain)


def number(text: Any) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def hosts_ranks(group: PodGroup) -> bool:
    """The head can run training workers: it offers Ray CPUs or GPUs (raylane's heads say num-cpus 0)."""
    cpus = cpus_per_pod(group)
    return gpus_per_pod(group) > 0 or cpus is None or cpus > 0


def requires(pod: dict[str, Any], label: str, value: str) -> bool:
    """The pod is placed on nodes with label=value: its nodeSelector, or a required node-affinity term."""
    if str((pod.get("nodeSelector") or {}).get(label)) == value:
        return True
    terms = get(pod, "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution", "nodeSelectorTerms")
    for term in terms or []:
        for e in get(term, "matchExpressions", default=[]) or []:
            if e.get("key") == label and e.get("operator") == "In" and value in (e.get("values") or []):
                return True
    return False


def spot_window(group: PodGroup, annotations: dict[str, Any]) -> tuple[float, str, str] | None:
    """(seconds, "<platform> give(s)", overlay) for a group on spot capacity, else None."""
    for label, value, seconds, platform, overlay in SPOT_LABELS:
        if requires(group.pod, label, value):
            declared = number(annotations.get(SPOT_WINDOW_ANNOTATION))
            if declared:
                return declared, f"{SPOT_WINDOW_ANNOTATION} gives", overlay
            return float(seconds), platform, overlay
    return None


def check_preemption(groups: list[PodGroup], env: dict[str, str | None], annotations: dict[str, Any]) -> Iterator[Rule]:
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
    notice = (number(env.get(POLL_ENV)) or POLL_DEFAULT_S) + RAYLANE_DRAIN_POLL_S
    for g in groups:
        if g.is_head and not hosts_ranks(g):  # its deletion ends the cluster whatever the window
            continue
        found = env_value(g.ray_container, DRAIN_ENV)
        drain = DRAIN_DEFAULT_S if found is None else number(found[1])
        if drain is None:  # from a Secret or not a number: Ray's own parse decides
            continue
        yield from check_window(g, found, drain, notice, spot_window(g, annotations))


def check_window(
    g: PodGroup, found: tuple[int, str | None] | None, drain: float, notice: float, spot: tuple[float, str, str] | None
) -> Iterator[Rule]:
    """One line at most for a group: the first of the window's rules it breaks."""
    where = f"{g.path}.template.spec"
    grace = g.pod.get("terminationGracePeriodSeconds", GRACE_DEFAULT_S)
    if drain <= 0:
        yield (
            f"{where}.containers[0].env",
            "raylane.preemption",
            (
                f"{DRAIN_ENV}={found[1] if found else ''}: draining is off, so a deleted pod's ranks get no "
                "notice and the steps since the last checkpoint are lost"
            ),
        )
    elif drain - notice < CHECKPOINT_MIN_S:
        yield (
            f"{where}.containers[0].env",
            "raylane.preemption",
            (
                f"{DRAIN_ENV}={drain:g}: the drain notice reaches the ranks up to {notice:g} s after SIGTERM "
                f"({POLL_ENV} + raylane's {RAYLANE_DRAIN_POLL_S:g}), leaving {max(drain - notice, 0):g} s for the step "
                f"and the checkpoint; leave at least {CHECKPOINT_MIN_S:g} (a drain of {notice + CHECKPOINT_MIN_S:g} s "
                "or more, more for a checkpoint that takes longer)"
            ),
        )
    elif spot is not None and grace > spot[0]:
        seconds, platform, overlay = spot
        kit = KIT_WINDOWS[overlay]
        shown = "" if "terminationGracePeriodSeconds" in g.pod else " (Kubernetes' default)"
        yield (
            f"{where}.terminationGracePeriodSeconds",
            "raylane.spot-window",
            (
                f"{grace}{shown}: {platform} a pod at most {seconds:g} s after SIGTERM, whatever it asks, so the "
                f"drain ({DRAIN_ENV}={drain:g}) and the checkpoint would be cut off; set it to {seconds:g} or less "
                f"and the drain below it (the {overlay} overlay: {kit[0]} and {kit[1]}; group {g.name})"
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
