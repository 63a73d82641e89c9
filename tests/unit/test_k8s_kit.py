"""`raylane k8s check` on the shipped kit as a team edits it (the field report of 2026-11-29, part
B): a kit made with `raylane k8s init` into tmp, its CHANGE-ME placeholders filled, one edit, one
overlay rendered and checked in process. Each edit that would fail on the cluster fails with one
line naming the file, the object, the field and the rule; each right setup beside it passes."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import yaml

from raylane.cli import parser
from raylane.k8s import check, check_paths

pytestmark = pytest.mark.skipif(
    not (Path("/usr/bin/kubectl").exists() or shutil.which("kubectl")),
    reason="kubectl is not installed: `kubectl kustomize` renders the kit",
)
RAY = version("ray")
OTHER = "2.59.0" if RAY != "2.59.0" else "2.60.0"
DIGEST = "sha256:" + "0123456789abcdef" * 4
Edit = Callable[[Path], None]


def kit(tmp_path: Path, fill: bool = True) -> Path:
    """`raylane k8s init` into tmp, the placeholders filled in as a team would."""
    folder = tmp_path / "kuberay"
    check.init(str(folder))
    for path in folder.rglob("*"):
        if fill and path.is_file():
            path.write_text(path.read_text().replace("CHANGE-ME-", "acme-"))
    return folder


def lines(*paths: Path) -> list[str]:
    return [f.line() for f in check_paths([str(p) for p in paths], parser).findings]


def text(file: str, old: str, new: str, count: int = -1) -> Edit:
    def edit(folder: Path) -> None:
        path = folder / file
        body = path.read_text()
        assert old in body, (file, old)
        path.write_text(body.replace(old, new, count))

    return edit


def docs(file: str, change: Callable[[list[Any]], None]) -> Edit:
    """An edit of the parsed documents of `file` (comments are lost; kustomize does not mind)."""

    def edit(folder: Path) -> None:
        path = folder / file
        found = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        change(found)
        path.write_text(yaml.safe_dump_all(found, sort_keys=False))

    return edit


def both(*edits: Edit) -> Edit:
    def edit(folder: Path) -> None:
        for one in edits:
            one(folder)

    return edit


def workers(d: dict[str, Any]) -> list[dict[str, Any]]:
    spec = d["spec"]["rayClusterSpec"] if d["kind"] == "RayJob" else d["spec"]
    return spec["workerGroupSpecs"]


def head(d: dict[str, Any]) -> dict[str, Any]:
    spec = d["spec"]["rayClusterSpec"] if d["kind"] == "RayJob" else d["spec"]
    return spec["headGroupSpec"]


def ray_container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


def gpus(requests: str | None, limits: str | None) -> Edit:
    def change(found: list[Any]) -> None:
        resources = ray_container(workers(found[0])[0])["resources"]
        for part, value in (("requests", requests), ("limits", limits)):
            resources[part].pop("nvidia.com/gpu")
            if value is not None:
                resources[part]["nvidia.com/gpu"] = value

    return docs("base/rayjob.yaml", change)


def annotate(file: str, annotations: dict[str, str]) -> Edit:
    return docs(file, lambda found: found[0]["metadata"].setdefault("annotations", {}).update(annotations))


def head_env(name: str, source: dict[str, Any]) -> Edit:
    return docs("base/rayjob.yaml", lambda found: ray_container(head(found[0]))["env"].append({"name": name, **source}))


def no_service_account_on_workers(found: list[Any]) -> None:
    for group in workers(found[0]):
        group["template"]["spec"].pop("serviceAccountName")


def tracking_uri(uri: str, allowed: str = "") -> Edit:
    """MLFLOW_TRACKING_URI of the RayJob and the RayCluster, and a host the MLflow server allows."""
    default = "http://mlflow.raylane.svc.cluster.local:5000"
    edits = [text("base/rayjob.yaml", default, uri), text("base/raycluster.yaml", default, uri)]
    if allowed:
        edits.append(text("base/mlflow.yaml", "--allowed-hosts=", f"--allowed-hosts={allowed},"))
    return both(*edits)


def spot_window(overlay: str, grace: str, drain: str) -> Edit:
    def edit(folder: Path) -> None:
        path = folder / "overlays" / overlay / "spot-window.yaml"
        body = re.sub(r'grace: "\d+"', f'grace: "{grace}"', path.read_text())
        path.write_text(re.sub(r'drain: "\d+"', f'drain: "{drain}"', body))

    return edit


def images(overlay: str, **image: str) -> Edit:
    def edit(folder: Path) -> None:
        path = folder / "overlays" / overlay / "kustomization.yaml"
        entry = {"name": "raylane", "newName": "111122223333.dkr.ecr.us-east-1.amazonaws.com/raylane", **image}
        path.write_text(path.read_text() + yaml.safe_dump({"images": [entry]}))

    return edit


def versions(key: str, value: str) -> Edit:
    return docs("base/versions.yaml", lambda found: found[0]["data"].__setitem__(key, value))


INGRESS = """\
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata:
  name: mlflow
  labels:
    app.kubernetes.io/component: shared
spec:
  rules:
    - host: mlflow.ml.acme.internal
      http:
        paths:
          - path: /
            pathType: Prefix
            backend:
              service:
                name: mlflow
                port:
                  number: 5000
"""


def add_resource(name: str, body: str) -> Edit:
    def edit(folder: Path) -> None:
        (folder / "base" / name).write_text(body)
        text("base/kustomization.yaml", "  - raycluster.yaml\n", f"  - raycluster.yaml\n  - {name}\n")(folder)

    return edit


EXTERNAL_NAME = """\
apiVersion: v1
kind: Service
metadata:
  name: tracking
  labels:
    app.kubernetes.io/component: shared
spec:
  type: ExternalName
  externalName: mlflow.ml.acme.internal
"""

HF_TOKEN = {"valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
HF_TOKN = {"valueFrom": {"secretKeyRef": {"name": "hf-tokn", "key": "token"}}}
SECRET = """\
apiVersion: v1
kind: Secret
metadata:
  name: hf-token
  labels:
    app.kubernetes.io/component: shared
stringData:
  token: from-ci
"""
DOCKER_PIN = f'RUN pip install --no-cache-dir "ray[default]=={OTHER}"\n'

# (id, edit, what to check: an overlay or "Dockerfile+<overlay>", rule, what the one line names)
BROKEN: list[tuple[str, Edit, str, str, str]] = [
    (
        "gpus-requested-without-a-limit",
        gpus("4", None),
        "aws-karpenter",
        "pod.extended-resource",
        "workerGroupSpecs[0].template.spec.containers[0].resources.limits: nvidia.com/gpu: requested (4) with no limit",
    ),
    (
        "gpu-limit-below-the-request",
        gpus("8", "4"),
        "aws-karpenter",
        "pod.extended-resource",
        "workerGroupSpecs[0].template.spec.containers[0].resources.requests: nvidia.com/gpu: requests 8, limits 4",
    ),
    (
        "namespace-changed-in-the-kustomization-alone",
        text("base/kustomization.yaml", "namespace: raylane", "namespace: ml-train"),
        "gke-spot",
        "raylane.mlflow-service",
        "names Service mlflow in namespace 'raylane', but these files put it in 'ml-train'",
    ),
    (
        "secret-name-misspelt",
        both(annotate("base/rayjob.yaml", {"raylane.io/external": "Secret/hf-token"}), head_env("HF_TOKEN", HF_TOKN)),
        "aws-karpenter",
        "ref.secret",
        "valueFrom.secretKeyRef.name: Secret 'hf-tokn': not in these files (did you mean 'hf-token'?)",
    ),
    (
        "raycluster-token-secret-misspelt",
        text("base/raycluster.yaml", "secretName: raylane-ray-token", "secretName: raylane-ray-tokn"),
        "gke-spot",
        "ref.secret",
        "RayCluster/raylane: spec.authOptions.secretName: Secret 'raylane-ray-tokn'",
    ),
    (
        "service-account-the-files-do-not-define",
        text("base/rayjob.yaml", "serviceAccountName: raylane", "serviceAccountName: raylane-sa"),
        "aws-karpenter",
        "ref.service-account",
        "ServiceAccount 'raylane-sa': not in these files (did you mean 'raylane'?)",
    ),
    (
        "an-ingress-to-a-port-the-service-lacks",
        both(
            add_resource("ingress.yaml", INGRESS.replace("number: 5000", "number: 5001")),
            tracking_uri("https://mlflow.ml.acme.internal", allowed="mlflow.ml.acme.internal"),
        ),
        "aws-karpenter",
        "raylane.mlflow-service",
        "Ingress/mlflow routes mlflow.ml.acme.internal to Service 'mlflow' port 5001, which these files do not define",
    ),
    (
        "an-ingress-host-the-server-does-not-allow",
        both(add_resource("ingress.yaml", INGRESS), tracking_uri("https://mlflow.ml.acme.internal")),
        "aws-karpenter",
        "raylane.mlflow-host",
        "Host 'mlflow.ml.acme.internal' is not in the MLflow server's allowed hosts",
    ),
    (
        "workers-without-the-account-that-reaches-s3",
        docs("base/rayjob.yaml", no_service_account_on_workers),
        "aws-karpenter",
        "raylane.storage-identity",
        "workerGroupSpecs[0].template.spec.serviceAccountName: not set",
    ),
    (
        "dockerfile-pip-install-without-its-constraint",
        text("Dockerfile", "-c /tmp/keep-ray.txt ", ""),
        "Dockerfile+aws-karpenter",
        "docker.ray-constraint",
        "Dockerfile: line 25: ",
    ),
    (
        "dockerfile-pip-install-of-another-ray",
        text("Dockerfile", "\n# The MLflow server", f"\n{DOCKER_PIN}# The MLflow server"),
        "Dockerfile+aws-karpenter",
        "docker.ray-version",
        f"pins ray=={OTHER}, but raylane runs Ray {RAY}",
    ),
    (
        "image-pinned-by-digest-alone",
        images("aws-karpenter", digest=DIGEST),
        "aws-karpenter",
        "raylane.image-tag",
        "pinned by digest alone",
    ),
    (
        "gke-spot-window-longer-than-gke-gives",
        spot_window("gke-spot", "30", "25"),
        "gke-spot",
        "raylane.spot-window",
        "terminationGracePeriodSeconds: 30: GKE Spot VMs give a pod at most 15 s",
    ),
    (
        "ec2-spot-window-longer-than-the-notice",
        spot_window("aws-karpenter", "300", "280"),
        "aws-karpenter",
        "raylane.spot-window",
        "terminationGracePeriodSeconds: 300: EC2 Spot gives a pod at most 110 s",
    ),
    (
        "drain-too-short-for-a-checkpoint",
        spot_window("gke-spot", "15", "2"),
        "gke-spot",
        "raylane.preemption",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=2: the drain notice reaches the ranks up to 1.5 s after SIGTERM",
    ),
    (
        "ray-version-other-than-raylanes",
        versions("ray", OTHER),
        "aws-karpenter",
        "raylane.ray-version",
        f"'{OTHER}': raylane runs Ray {RAY}",
    ),
    (
        "image-tag-of-another-ray",
        versions("image", f"raylane:0.1.0-ray{OTHER}-cu12"),
        "aws-karpenter",
        "raylane.image-tag",
        f"its tag names Ray {OTHER}, but raylane runs Ray {RAY}: build it on Ray {RAY} and tag it so "
        f"(raylane:0.1.0-ray{RAY}-cu12)",
    ),
]


@pytest.mark.parametrize("name, edit, target, rule, named", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_kit_edit_that_fails_on_the_cluster_fails_in_one_line(tmp_path, name, edit, target, rule, named):
    folder = kit(tmp_path)
    edit(folder)
    dockerfile, _, overlay = target.rpartition("+")
    paths = [folder / "overlays" / overlay] + ([folder / dockerfile] if dockerfile else [])
    found = lines(*paths)
    assert len(found) == 1, found
    assert found[0].endswith(f"[{rule}]") and named in found[0], found[0]


# (id, edit, overlay): right setups, several of which the check refused before.
RIGHT: list[tuple[str, Edit, str]] = [
    ("mlflow-behind-an-ingress-by-https", tracking_uri("https://mlflow.ml.acme.internal"), "aws-karpenter"),
    ("mlflow-at-an-external-name-and-port", tracking_uri("http://tracking.acme.internal:5000"), "aws-karpenter"),
    (
        "mlflow-through-an-ingress-of-these-files",
        both(
            add_resource("ingress.yaml", INGRESS),
            tracking_uri("https://mlflow.ml.acme.internal", allowed="mlflow.ml.acme.internal"),
        ),
        "aws-karpenter",
    ),
    (
        "mlflow-through-an-externalname-service",
        both(add_resource("tracking.yaml", EXTERNAL_NAME), tracking_uri("http://tracking:5000")),
        "gke-spot",
    ),
    (
        "namespace-changed-everywhere",
        both(
            text("base/kustomization.yaml", "namespace: raylane", "namespace: ml-train"),
            text("base/rayjob.yaml", "mlflow.raylane.", "mlflow.ml-train."),
            text("base/raycluster.yaml", "mlflow.raylane.", "mlflow.ml-train."),
            text("base/mlflow.yaml", "mlflow.raylane", "mlflow.ml-train"),
        ),
        "gke-spot",
    ),
    (
        "mlflow-by-service-and-namespace-only",
        tracking_uri("http://mlflow.raylane:5000"),
        "aws-karpenter",
    ),
    (
        "secret-made-outside-the-files-declared",
        both(annotate("base/rayjob.yaml", {"raylane.io/external": "Secret/hf-token"}), head_env("HF_TOKEN", HF_TOKEN)),
        "aws-karpenter",
    ),
    ("secret-in-the-files", both(add_resource("secret.yaml", SECRET), head_env("HF_TOKEN", HF_TOKEN)), "aws-karpenter"),
    (
        "optional-secret",
        head_env("HF_TOKEN", {"valueFrom": {"secretKeyRef": {"name": "hf-tokn", "key": "t", "optional": True}}}),
        "aws-karpenter",
    ),
    (
        "image-pinned-by-digest-beside-its-tag",
        images("aws-karpenter", newTag=f"0.1.0-ray{RAY}-cu12", digest=DIGEST),
        "aws-karpenter",
    ),
    (
        "a-longer-gke-window-declared",
        both(
            spot_window("gke-spot", "60", "45"),
            annotate("base/rayjob.yaml", {"raylane.io/spot-window-s": "60"}),
            annotate("base/raycluster.yaml", {"raylane.io/spot-window-s": "60"}),
        ),
        "gke-spot",
    ),
]


@pytest.mark.parametrize("name, edit, overlay", RIGHT, ids=[r[0] for r in RIGHT])
def test_a_right_setup_passes(tmp_path, name, edit, overlay):
    folder = kit(tmp_path)
    edit(folder)
    assert lines(folder / "overlays" / overlay, folder / "Dockerfile") == []


def test_the_kits_placeholders_fail_one_line_each(tmp_path):
    """Left as shipped, the bucket (the entrypoint's and MLflow's) and the two IAM roles."""
    found = lines(kit(tmp_path, fill=False) / "overlays" / "aws-karpenter")
    assert len(found) == 4 and all(line.endswith("[raylane.placeholder]") for line in found), found
    assert {line.split(": ")[1] for line in found} == {
        "RayJob/gpt2-124m",
        "Deployment/mlflow",
        "ServiceAccount/raylane",
        "ServiceAccount/mlflow",
    }
    assert any("spec.entrypoint: 'run.storage_path=s3://CHANGE-ME-bucket/raylane'" in line for line in found), found
    assert any("metadata.annotations.eks.amazonaws.com/role-arn: " in line for line in found), found


def test_a_wrong_ray_version_is_one_line_whatever_names_it(tmp_path):
    """rayVersion, every image and the Dockerfile on another Ray: one line for that version, with
    the advice to build on raylane's; a second wrong version is a second line."""
    folder = kit(tmp_path)
    versions("ray", OTHER)(folder)
    versions("image", f"raylane:0.1.0-ray{OTHER}-cu12")(folder)
    text("Dockerfile", f"rayproject/ray:{RAY}", f"rayproject/ray:{OTHER}")(folder)
    found = lines(folder)
    assert len(found) == 1, found
    assert f"raylane runs Ray {RAY}" in found[0] and "more places" in found[0], found[0]
    versions("image", "raylane:0.1.0-ray2.58.0-cu12")(folder)
    found = lines(folder)
    assert len(found) == 2 and "its tag names Ray 2.58.0" in found[1], found


def test_a_pipeline_that_does_not_import_here_says_what_ci_needs(tmp_path):
    folder = kit(tmp_path)
    (folder / "base" / "team.yaml").write_text("pipeline: team_pipeline\n")
    text("base/rayjob.yaml", "raylane train gpt2-124m", "raylane train /app/team.yaml")(folder)
    found = lines(folder / "overlays" / "aws-karpenter")
    assert len(found) == 1 and found[0].endswith("[raylane.config]"), found
    assert "the pipeline's code must be importable where `raylane k8s check` runs" in found[0], found[0]
