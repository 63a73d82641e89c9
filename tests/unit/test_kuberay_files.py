"""The KubeRay kit raylane ships (app/raylane/k8s/kuberay: package data, copied out by `raylane
k8s init`): each overlay renders offline with `kubectl kustomize`, and what would fail quietly on
a cluster holds in what it renders. The entrypoint needs no shell quoting and passes raylane's
own parser and config loader, the spot drain fits inside the pod's grace period, MLflow admits
the host the runs reach it by, and the image, rayVersion and the Ray beside raylane agree.
`raylane k8s check` validates the rest (the CRD schemas, the operator's rules)."""

from __future__ import annotations

import functools
import glob
import re
import shlex
import shutil
import subprocess
from importlib.metadata import version
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from tests.conftest import REPO

KIT = REPO / "app" / "raylane" / "k8s" / "kuberay"
OVERLAYS = sorted(p.name for p in (KIT / "overlays").iterdir())
# Each cloud's spot window: (terminationGracePeriodSeconds, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S).
SPOT_WINDOWS = {"aws-karpenter": (110, 90), "gke-spot": (15, 12)}
DRAIN = "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"
# What a shell would read in an unquoted word; KubeRay's submitter and Ray's job supervisor each
# run the entrypoint through one.
SHELL_SPECIAL = re.compile(r"""[][*?;&|<>()$`'"\\{}~#!]""")
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed: `kubectl kustomize` renders the kit"
)


@functools.cache
def rendered(overlay: str) -> tuple[dict, ...]:
    """The objects `kubectl kustomize` renders for `overlay` (or `base`), offline."""
    where = KIT / "base" if overlay == "base" else KIT / "overlays" / overlay
    out = subprocess.run([KUBECTL, "kustomize", str(where)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {where.relative_to(REPO)}: {out.stderr.strip()}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def of_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def cluster_specs(objects) -> list[tuple[str, dict]]:
    """(name, RayCluster spec) of the RayCluster and of every RayJob's cluster."""
    specs = [(f"RayCluster {o['metadata']['name']}", o["spec"]) for o in of_kind(objects, "RayCluster")]
    specs += [(f"RayJob {o['metadata']['name']}", o["spec"]["rayClusterSpec"]) for o in of_kind(objects, "RayJob")]
    return specs


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def tracking_uris(objects) -> list[str]:
    """MLFLOW_TRACKING_URI as the RayJobs' runtime env and the RayClusters' heads give it."""
    uris = [
        yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]["MLFLOW_TRACKING_URI"]
        for job in of_kind(objects, "RayJob")
    ]
    for cluster in of_kind(objects, "RayCluster"):
        uris += [
            env_of(c)["MLFLOW_TRACKING_URI"] for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
        ]
    return uris


@needs_kubectl
@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_each_overlay_renders_one_of_each_part(overlay):
    kinds = sorted(o["kind"] for o in rendered(overlay))
    assert kinds == ["Deployment", "Namespace", "RayCluster", "RayJob", "Service", "ServiceAccount", "ServiceAccount"]
    assert all(o["metadata"].get("labels", {}).get("app.kubernetes.io/component") for o in rendered(overlay))


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_entrypoint_parses_as_raylane_reads_it_without_shell_quoting(overlay):
    from raylane.cli import parser
    from raylane.config import load_config

    (job,) = of_kind(rendered(overlay), "RayJob")
    entrypoint = job["spec"]["entrypoint"]
    assert not SHELL_SPECIAL.search(entrypoint), f"entrypoint needs shell quoting: {entrypoint!r}"
    argv = entrypoint.split()
    assert shlex.split(entrypoint) == argv
    assert argv[0] == "raylane"
    args = parser().parse_args(argv[1:])
    assert args.command == "train" and args.address is None  # the job supervisor sets RAY_ADDRESS
    cfg = load_config(args.config, args.overrides, outputs=False)
    assert cfg.run.storage_path.startswith("s3://") and cfg.run.name  # shared storage; a retry resumes
    assert cfg.scaling.use_gpu
    assert cfg.failure.max_failures != 0  # a lost spot node restarts the group rather than ending the run
    # No more GPUs than the worker groups can hold at their largest.
    gpus = sum(
        g["maxReplicas"] * int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    )
    assert cfg.scaling.num_workers * cfg.scaling.gpus_per_worker <= gpus


def test_the_entrypoint_check_catches_a_bracketed_list():
    assert SHELL_SPECIAL.search("raylane train digits --set scaling.num_workers=[8,16]")
    assert not SHELL_SPECIAL.search(
        "raylane train digits --set scaling.num_workers=8,16 --set run.storage_path=s3://b/p"
    )


@needs_kubectl
@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_every_ray_pod_outlives_its_drain(overlay):
    for name, spec in cluster_specs(rendered(overlay)):
        for group in [{"groupName": "head", **spec["headGroupSpec"]}, *spec["workerGroupSpecs"]]:
            pod = group["template"]["spec"]
            drain = float(env_of(pod["containers"][0])[DRAIN])
            grace = pod["terminationGracePeriodSeconds"]
            assert isinstance(grace, int) and grace > drain > 0, f"{overlay}: {name} {group['groupName']}"
            if group["groupName"] == "gpu-spot" and overlay in SPOT_WINDOWS:
                assert (grace, drain) == SPOT_WINDOWS[overlay], f"{overlay}: {name}"


def test_the_checker_holds_each_overlay_to_its_platforms_window():
    """`raylane k8s check` bounds a spot group by its platform's window (raylane.k8s.preemption):
    the overlays' windows are the ones it names in its advice, and fit inside it."""
    from raylane.k8s import preemption

    assert preemption.KIT_WINDOWS == SPOT_WINDOWS
    for overlay, (grace, drain) in SPOT_WINDOWS.items():
        window = min(s for _, _, s, _, o in preemption.SPOT_LABELS if o == overlay)
        notice = 1 + preemption.RAYLANE_DRAIN_POLL_S  # the overlays poll every second
        assert grace <= window and drain - notice >= preemption.CHECKPOINT_MIN_S, overlay


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_mlflow_admits_the_host_the_runs_reach_it_by(overlay):
    (server,) = [d for d in of_kind(rendered(overlay), "Deployment") if d["metadata"]["name"] == "mlflow"]
    args = server["spec"]["template"]["spec"]["containers"][0]["args"]
    allowed = next(a.partition("=")[2] for a in args if a.startswith("--allowed-hosts=")).split(",")
    assert "--serve-artifacts" in args
    assert any(a.startswith("--artifacts-destination=s3://") for a in args)
    for uri in tracking_uris(rendered(overlay)):
        parts = urlsplit(uri)
        assert parts.scheme == "http" and parts.port == 5000, uri
        # MLflow compares the Host header as sent: the name with its port, and without.
        assert parts.netloc in allowed and parts.hostname in allowed, (uri, allowed)
        assert parts.hostname.split(".")[:2] == ["mlflow", server["metadata"]["namespace"]], uri


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rayversion_and_every_image_name_the_installed_ray(overlay):
    ray = version("ray")
    objects = rendered(overlay)
    for name, spec in cluster_specs(objects):
        assert str(spec["rayVersion"]) == ray, name
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        images = [c["image"] for g in groups for c in g["template"]["spec"]["containers"]]
        assert images and all(f"-ray{ray}-" in image or "@sha256:" in image for image in images), (name, images)
        assert spec["authOptions"]["mode"] == "token", name
        assert all(g["minReplicas"] == 0 for g in spec["workerGroupSpecs"]), name


def test_the_dockerfile_keeps_ray_start_as_pid_1_on_the_installed_ray():
    text = (KIT / "Dockerfile").read_text()
    instructions = [
        line.split()[0].upper() for line in text.splitlines() if line.strip() and not line.startswith((" ", "#"))
    ]
    assert "ENTRYPOINT" not in instructions and "CMD" not in instructions
    (base,) = re.findall(r"(?m)^FROM\s+rayproject/ray:(\S+)", text)
    assert base.split("-")[0] == version("ray") and base.endswith("-gpu")
    assert f"ray.__version__ == '{version('ray')}'" in text  # asserted when the image is built
    assert "pip check" in text and "keep-ray.txt" in text
    assert re.search(r"torch==\$\{TORCH_VERSION\}", text) and f"TORCH_VERSION={version('torch').split('+')[0]}" in text


def test_a_wheel_carries_every_file_of_the_kit():
    """pyproject's package-data globs, expanded as setuptools does (glob, recursive; no dotfiles),
    cover every file of the kit: a file they missed would be absent from `raylane k8s init`."""
    # tomllib is Python 3.11's, and raylane runs on 3.10: the one line, read as YAML's flow list.
    (line,) = re.findall(r'(?m)^"raylane\.k8s" = (\[.*\])$', (REPO / "pyproject.toml").read_text())
    package = REPO / "app" / "raylane" / "k8s"
    patterns = yaml.safe_load(line)
    matched = {Path(p) for pattern in patterns for p in glob.glob(str(package / pattern), recursive=True)}
    assert {p for p in matched if p.is_file() and KIT in p.parents} == {p for p in KIT.rglob("*") if p.is_file()}
