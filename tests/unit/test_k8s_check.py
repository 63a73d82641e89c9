"""`raylane k8s check`: a good RayJob, RayCluster and MLflow set (tests/helpers/k8s, modelled on
kuberay-notes.md §1.1) passes, and each broken variant fails with exactly one line naming its
rule: the schema as the API server applies it, the KubeRay operator's rules, raylane's side of
the manifest and the Dockerfile. In process (the schemas load once), plus one CLI run."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from raylane.cli import parser
from raylane.config import ConfigError
from raylane.k8s import check, check_paths, schema
from tests.conftest import REPO, cli_env

FIXTURE = REPO / "tests" / "helpers" / "k8s"
Edit = Callable[[Any], None]


def run_check(folder: Path) -> list[str]:
    return [f.line() for f in check_paths([str(folder)], parser).findings]


def broken(tmp_path: Path, file: str, edit: Edit, doc: int = 0) -> list[str]:
    """The fixture with one edit to the `doc`th document of `file`, checked."""
    folder = tmp_path / "k8s"
    shutil.copytree(FIXTURE, folder)
    path = folder / file
    if file == "Dockerfile":
        path.write_text(edit(path.read_text()))
    else:
        docs = list(yaml.safe_load_all(path.read_text()))
        edit(docs[doc])
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return run_check(folder)


def job_spec(d: Any) -> Any:
    return d["spec"]


def cluster(d: Any) -> Any:
    return d["spec"]["rayClusterSpec"]


def worker(d: Any, i: int = 0) -> Any:
    return cluster(d)["workerGroupSpecs"][i]


def entry(replace: str, by: str) -> Edit:
    def edit(d: Any) -> None:
        assert replace in d["spec"]["entrypoint"]
        d["spec"]["entrypoint"] = d["spec"]["entrypoint"].replace(replace, by)

    return edit


def runtime_env(line: str) -> Edit:
    def edit(d: Any) -> None:
        d["spec"]["runtimeEnvYAML"] += f"  {line}\n"

    return edit


def set_version(d: Any, version: str) -> None:
    cluster(d)["rayVersion"] = version
    for g in [cluster(d)["headGroupSpec"], *cluster(d)["workerGroupSpecs"]]:
        c = g["template"]["spec"]["containers"][0]
        c["image"] = c["image"].replace("2.60.0", version)


def test_the_good_set_passes():
    report = check_paths([str(FIXTURE)], parser)
    assert [f.line() for f in report.findings] == []
    assert report.checked == 6 and report.summary().startswith("all 6 objects pass (KubeRay 1.7.0")


def test_what_the_api_server_forgives_passes(tmp_path):
    """Nulls are pruned and defaults applied before validating, as the API server does: a null
    metadata and a worker group without maxReplicas (required, and defaulted) are accepted."""

    def edit(d: Any) -> None:
        cluster(d)["headGroupSpec"]["template"]["metadata"] = None
        del worker(d, 1)["maxReplicas"]
        worker(d, 0)["template"]["spec"]["containers"][0]["env"].append({"name": "X", "value": None})

    assert broken(tmp_path, "rayjob.yaml", edit) == []


VARIANTS: list[tuple[str, str, Edit, str, str]] = [
    # (id, file, edit, rule, what the line must name)
    (
        "unknown-field-in-a-pod",
        "rayjob.yaml",
        lambda d: worker(d)["template"]["spec"].__setitem__("tolerationz", []),
        "schema.unknown-field",
        "workerGroupSpecs[0].template.spec.tolerationz",
    ),
    (
        "misspelt-cluster-field",
        "rayjob.yaml",
        lambda d: cluster(d).__setitem__("enableInTreeAutoScaling", True),
        "schema.unknown-field",
        "did you mean enableInTreeAutoscaling?",
    ),
    (
        "env-value-not-a-string",
        "rayjob.yaml",
        lambda d: worker(d)["template"]["spec"]["containers"][0]["env"].__setitem__(1, {"name": "A", "value": 1}),
        "schema.type",
        "containers[0].env[1].value",
    ),
    (
        "bad-quantity",
        "rayjob.yaml",
        lambda d: worker(d)["template"]["spec"]["containers"][0]["resources"]["limits"].__setitem__("memory", "170GB"),
        "schema.pattern",
        "resources.limits.memory: '170GB' is not a quantity",
    ),
    (
        "cel-deletion-condition",
        "rayjob.yaml",
        lambda d: (
            job_spec(d).__setitem__("shutdownAfterJobFinishes", False),
            job_spec(d).pop("ttlSecondsAfterFinished"),
            job_spec(d).__setitem__(
                "deletionStrategy",
                {
                    "deletionRules": [
                        {
                            "policy": "DeleteCluster",
                            "condition": {"jobStatus": "SUCCEEDED", "jobDeploymentStatus": "Failed"},
                        }
                    ]
                },
            ),
        ),
        "schema.x-kubernetes-validations",
        "cannot be used together",
    ),
    (
        "min-above-max",
        "rayjob.yaml",
        lambda d: worker(d, 1).__setitem__("minReplicas", 5),
        "operator.min-max-replicas",
        "workerGroupSpecs[1].minReplicas: 5: more than maxReplicas (4)",
    ),
    (
        "suspend-without-shutdown",
        "rayjob.yaml",
        lambda d: (
            job_spec(d).update(suspend=True, shutdownAfterJobFinishes=False),
            job_spec(d).pop("ttlSecondsAfterFinished"),
        ),
        "operator.suspend-needs-shutdown",
        "spec.suspend",
    ),
    (
        "ttl-without-shutdown",
        "rayjob.yaml",
        lambda d: job_spec(d).__setitem__("shutdownAfterJobFinishes", False),
        "operator.ttl-needs-shutdown",
        "spec.ttlSecondsAfterFinished",
    ),
    (
        "deletion-rules-with-shutdown",
        "rayjob.yaml",
        lambda d: job_spec(d).__setitem__(
            "deletionStrategy",
            {"deletionRules": [{"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED"}}]},
        ),
        "operator.deletion-rules",
        "mutually exclusive",
    ),
    (
        "restart-policy-under-autoscaler-v2",
        "rayjob.yaml",
        lambda d: worker(d)["template"]["spec"].__setitem__("restartPolicy", "Always"),
        "operator.restart-policy",
        "workerGroupSpecs[0].template.spec.restartPolicy",
    ),
    (
        "submission-mode-typo",
        "rayjob.yaml",
        lambda d: job_spec(d).__setitem__("submissionMode", "K8sJob"),
        "operator.submission-mode",
        "spec.submissionMode",
    ),
    (
        "runtime-env-not-yaml",
        "rayjob.yaml",
        lambda d: job_spec(d).__setitem__("runtimeEnvYAML", "env_vars: {MLFLOW_TRACKING_URI: [\n"),
        "operator.runtime-env",
        "spec.runtimeEnvYAML: not valid YAML",
    ),
    (
        "no-cluster-at-all",
        "rayjob.yaml",
        lambda d: job_spec(d).pop("rayClusterSpec"),
        "operator.cluster",
        "one of rayClusterSpec or clusterSelector must be set",
    ),
    (
        "rayjob-name-too-long",
        "rayjob.yaml",
        lambda d: d["metadata"].__setitem__("name", "g" * 48),
        "operator.name",
        "at most 47 characters",
    ),
    (
        "entrypoint-needs-quoting",
        "rayjob.yaml",
        entry("scaling.num_workers=8,16", "scaling.num_workers=[8,16]"),
        "raylane.entrypoint-quoting",
        "'scaling.num_workers=[8,16]'",
    ),
    (
        "misspelt-flag",
        "rayjob.yaml",
        entry("--set run.name", "--sett run.name"),
        "raylane.entrypoint-args",
        "unrecognized arguments: --sett",
    ),
    (
        "misspelt-config-key",
        "rayjob.yaml",
        entry("run.name=", "run.nmae="),
        "raylane.config",
        "run.nmae",
    ),
    (
        "address-given",
        "rayjob.yaml",
        entry("raylane train gpt2-124m", "raylane train gpt2-124m --address auto"),
        "raylane.entrypoint-address",
        "--address",
    ),
    (
        "local-storage-path",
        "rayjob.yaml",
        entry("run.storage_path=s3://bucket/raylane", "run.storage_path=/tmp/runs"),
        "raylane.storage-path",
        "'/tmp/runs'",
    ),
    (
        "too-many-gpus",
        "rayjob.yaml",
        entry("scaling.num_workers=8,16", "scaling.num_workers=8,64"),
        "raylane.gpus",
        "64 x gpus_per_worker 1 = 64 GPUs, more than the worker groups can ever hold (48",
    ),
    (
        "no-run-name",
        "rayjob.yaml",
        entry("--set run.name=gpt2-124m-k8s ", ""),
        "raylane.run-name",
        "each RayJob retry would start a new run",
    ),
    (
        "more-workers-than-a-pods-cpus",
        "rayjob.yaml",
        lambda d: worker(d)["template"]["spec"]["containers"][0]["resources"]["limits"].__setitem__("cpu", "2"),
        "raylane.cpus",
        "4 GPUs make 4 workers of 1 CPUs, 4 CPUs in all, but the pod offers Ray 2",
    ),
    (
        "accelerator-type-no-group-declares",
        "rayjob.yaml",
        entry("--set scaling.use_gpu=true", "--set scaling.use_gpu=true --set scaling.accelerator_type=A10G"),
        "raylane.placement",
        "scaling.accelerator_type = 'A10G': no worker group declares accelerator_type:A10G",
    ),
    (
        "custom-resource-no-group-offers",
        "rayjob.yaml",
        entry("--set scaling.use_gpu=true", "--set scaling.use_gpu=true --set scaling.resources_per_worker.efa=1"),
        "raylane.placement",
        "scaling.resources_per_worker.efa = 1: no worker group offers 1 efa",
    ),
    (
        "mlflow-host-not-allowed",
        "mlflow.yaml",
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["args"].__setitem__(
            6, "mlflow,mlflow:5000,mlflow.raylane.svc.cluster.local"
        ),
        "raylane.mlflow-host",
        "Host 'mlflow.raylane.svc.cluster.local:5000' is not in the MLflow server's allowed hosts",
    ),
    (
        "mlflow-file-store",
        "rayjob.yaml",
        lambda d: job_spec(d).__setitem__(
            "runtimeEnvYAML",
            job_spec(d)["runtimeEnvYAML"].replace("http://mlflow.raylane.svc.cluster.local:5000", "/tmp/mlruns"),
        ),
        "raylane.mlflow-uri",
        "not an http(s) server",
    ),
    (
        "preemption-watcher-off",
        "rayjob.yaml",
        runtime_env('RAY_TRAIN_ENABLE_PREEMPTION_WATCHER: "0"'),
        "raylane.preemption",
        "preemption watcher is off",
    ),
    (
        "draining-off",
        "rayjob.yaml",
        lambda d: worker(d)["template"]["spec"]["containers"][0]["env"][0].__setitem__("value", "0"),
        "raylane.preemption",
        "draining is off",
    ),
    (
        "grace-shorter-than-drain",
        "rayjob.yaml",
        lambda d: worker(d)["template"]["spec"].__setitem__("terminationGracePeriodSeconds", 60),
        "raylane.grace-period",
        "workerGroupSpecs[0].template.spec.terminationGracePeriodSeconds: 60: not above the drain window",
    ),
    (
        "kubernetes-default-grace",
        "rayjob.yaml",
        lambda d: (
            worker(d, 1)["template"]["spec"].pop("terminationGracePeriodSeconds"),
            worker(d, 1)["template"]["spec"]["containers"][0].pop("env"),
        ),
        "raylane.grace-period",
        "30 (Kubernetes' default): not above the drain window RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=30",
    ),
    (
        "head-that-trains-on-default-grace",
        "rayjob.yaml",
        lambda d: cluster(d)["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", "8"),
        "raylane.grace-period",
        "headGroupSpec.template.spec.terminationGracePeriodSeconds: 30 (Kubernetes' default)",
    ),
    (
        "image-tag-without-ray-version",
        "rayjob.yaml",
        lambda d: worker(d, 1)["template"]["spec"]["containers"][0].__setitem__("image", "raylane:latest"),
        "raylane.image-tag",
        "'raylane:latest': its tag names no Ray version",
    ),
    (
        "dockerfile-entrypoint",
        "Dockerfile",
        lambda text: text + 'ENTRYPOINT ["raylane"]\n',
        "docker.entrypoint",
        "line 5",
    ),
    (
        "dockerfile-other-ray",
        "Dockerfile",
        lambda text: text.replace("ray:2.60.0", "ray:2.59.0"),
        "docker.ray-version",
        "FROM rayproject/ray:2.59.0-py311-gpu: its tag names Ray 2.59.0, but raylane runs Ray 2.60.0: build on "
        "rayproject/ray:2.60.0-py311-gpu",
    ),
    (
        "dockerfile-ray-not-kept",
        "Dockerfile",
        lambda text: text.replace("-c /tmp/keep-ray.txt ", ""),
        "docker.ray-constraint",
        "line 3",
    ),
    (
        "service-with-unknown-field",
        "mlflow.yaml",
        lambda d: d["spec"]["ports"][0].__setitem__("target_port", 5000),
        "schema.unknown-field",
        "Service/mlflow: spec.ports[0].target_port",
    ),
    (
        "external-declaration-not-kind-and-name",
        "rayjob.yaml",
        lambda d: d["metadata"].__setitem__("annotations", {"raylane.io/external": "Secret/hf, Sekret/hf"}),
        "ref.external",
        "metadata.annotations.raylane.io/external: 'Sekret/hf': not Kind/name with Kind one of Secret, ConfigMap",
    ),
    (
        "token-auth-on-old-ray",
        "raycluster.yaml",
        lambda d: d["spec"].pop("rayVersion"),
        "operator.token-auth",
        "spec.rayVersion: None: token auth (authOptions.mode: token) needs Ray >= 2.52.0",
    ),
]


@pytest.mark.parametrize("name, file, edit, rule, named", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_a_broken_rule_fails_with_one_line_naming_it(tmp_path, name, file, edit, rule, named):
    doc = 1 if name == "service-with-unknown-field" else 0
    lines = broken(tmp_path, file, edit, doc)
    if rule == "operator.token-auth":  # no rayVersion breaks raylane's rule too, in a line of its own
        assert (
            "spec.rayVersion: not set: write the Ray version the image holds (2.60.0) [raylane.ray-version]" in lines[1]
        )
        lines = lines[:1]
    assert len(lines) == 1, lines
    assert lines[0].endswith(f"[{rule}]") and named in lines[0], lines[0]
    reported = "rayjob.yaml" if rule == "raylane.mlflow-host" else file  # on the RayJob that reaches MLflow
    assert f"/k8s/{reported}: " in lines[0], lines[0]


def test_a_rayjob_made_for_another_ray_fails_once(tmp_path):
    """rayVersion and every image of the RayJob, and the Dockerfile, agree on Ray 2.59.0: only
    raylane's own Ray (the client's, 2.60.0 here) disagrees, in one line."""
    folder = tmp_path / "k8s"
    shutil.copytree(FIXTURE, folder)
    for name in ("rayjob.yaml", "Dockerfile", "keep-ray.txt"):
        (folder / name).write_text((folder / name).read_text().replace("2.60.0", "2.59.0"))
    paths = [str(folder / name) for name in ("rayjob.yaml", "mlflow.yaml", "Dockerfile")]
    lines = [f.line() for f in check_paths(paths, parser).findings]
    assert len(lines) == 1, lines
    assert lines[0].endswith(
        "RayJob/gpt2-124m: spec.rayClusterSpec.rayVersion: '2.59.0': raylane runs Ray 2.60.0 (installed here; raylane "
        'pins it, and the image and the client must run the same): write rayVersion: "2.60.0" and build the image on '
        "Ray 2.60.0 (and 5 more places: RayJob/gpt2-124m, Dockerfile) [raylane.ray-version]"
    ), lines


def test_every_cel_rule_of_the_vendored_schemas_is_known():
    """A schema refresh that brings a CEL rule the checker cannot evaluate fails here."""
    assert schema.unknown_cel_rules() == set()
    assert (schema.SCHEMAS / "SOURCE.json").is_file()


def test_a_kustomize_overlay_is_rendered_and_checked(tmp_path):
    """A folder with a kustomization.yaml is rendered with `kubectl kustomize` (offline)."""
    if not (Path("/usr/bin/kubectl").exists() or shutil.which("kubectl")):
        pytest.skip("kubectl is not installed")
    base = tmp_path / "base"
    shutil.copytree(FIXTURE, base)
    (base / "kustomization.yaml").write_text("resources: [rayjob.yaml, raycluster.yaml, mlflow.yaml]\n")
    overlay = tmp_path / "overlays" / "gke"
    overlay.mkdir(parents=True)
    patch = [
        {
            "op": "replace",
            "path": "/spec/rayClusterSpec/workerGroupSpecs/0/template/spec/terminationGracePeriodSeconds",
            "value": 15,
        }
    ]
    (overlay / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "resources": ["../../base"],
                "patches": [{"target": {"kind": "RayJob", "name": "gpt2-124m"}, "patch": yaml.safe_dump(patch)}],
            }
        )
    )
    lines = run_check(tmp_path)
    assert len(lines) == 1, lines
    # Named by the file the object came from, and the overlay it was rendered through.
    assert f"{base}/rayjob.yaml via {overlay}: RayJob/gpt2-124m: " in lines[0], lines[0]
    assert lines[0].endswith("[raylane.grace-period]")


def test_init_copies_the_manifests_and_never_overwrites(tmp_path):
    source = tmp_path / "shipped"
    shutil.copytree(FIXTURE, source)
    written = check.init(str(tmp_path / "mine"), source)
    assert sorted(p.name for p in written) == sorted(p.name for p in FIXTURE.iterdir())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "rayjob.yaml").write_text("mine")
    with pytest.raises(ConfigError, match=r"rayjob.yaml exists; nothing was written"):
        check.init(str(tmp_path / "other"), source)
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["rayjob.yaml"]


def test_the_command_exits_0_when_all_pass_and_2_with_one_line_per_broken_rule(tmp_path):
    folder = tmp_path / "k8s"
    shutil.copytree(FIXTURE, folder)
    job = folder / "rayjob.yaml"
    text = job.read_text().replace("run.storage_path=s3://bucket/raylane", "run.storage_path=runs")
    (folder / "bad.yaml").write_text(
        text.replace("name: gpt2-124m\n", "name: gpt2-bad\n").replace("minReplicas: 0", "minReplicas: 9", 1)
    )
    cmd = [sys.executable, "-m", "raylane", "k8s", "check"]
    good = subprocess.run([*cmd, str(FIXTURE)], capture_output=True, text=True, env=cli_env(tmp_path), timeout=60)
    assert good.returncode == 0 and good.stdout.startswith("all 6 objects pass"), good.stdout + good.stderr
    bad = subprocess.run([*cmd, str(folder)], capture_output=True, text=True, env=cli_env(tmp_path), timeout=60)
    lines = bad.stdout.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 2 and bad.stderr == "", bad.stdout + bad.stderr
    assert all("/k8s/bad.yaml: RayJob/gpt2-bad: " in line for line in lines), lines
    assert lines[0].endswith("minReplicas: 9: more than maxReplicas (8) [operator.min-max-replicas]"), lines
    assert lines[1].endswith("[raylane.storage-path]") and "run.storage_path = 'runs'" in lines[1], lines


def test_input_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, capsys):
    from raylane.cli import main

    (tmp_path / "bad.yaml").write_text("kind: RayJob\n  spec: [\n")
    (tmp_path / "empty").mkdir()
    for path, said in (
        (tmp_path / "none.yaml", "no such file or folder"),
        (tmp_path / "bad.yaml", "not valid YAML (line 2)"),
        (tmp_path / "empty", "no Kubernetes object or Dockerfile that raylane checks"),
    ):
        assert main(["k8s", "check", str(path)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"raylane: {path}: {said}") and err.count("\n") == 1, err


def test_the_dockerfile_is_read_as_docker_reads_it(tmp_path):
    """ARG defaults, --platform, continuation lines, comments and a final stage built FROM an
    earlier one (whose base names the Ray version)."""
    from raylane.k8s import dockerfile

    path = tmp_path / "Dockerfile"
    path.write_text(
        "ARG RAY=2.60.0\nFROM --platform=linux/amd64 rayproject/ray:${RAY}-py311-gpu AS base\n"
        "RUN pip install \\\n    # torch's CUDA wheel\n    -c keep.txt torch\nFROM base\nRUN pip check\n"
    )
    (tmp_path / "keep.txt").write_text("ray==2.60.0\n")
    assert dockerfile.check_dockerfile(path, "Dockerfile", "2.60.0") == []
    found = dockerfile.check_dockerfile(path, "Dockerfile", "2.59.0")
    assert [f.line() for f in found] == [
        "Dockerfile: Dockerfile: line 3: pip install: its constraint file keep.txt pins ray==2.60.0, but raylane runs "
        "Ray 2.59.0: pin ray==2.59.0 [docker.ray-version]",
        "Dockerfile: Dockerfile: line 6: FROM rayproject/ray:2.60.0-py311-gpu: its tag names Ray 2.60.0, but raylane "
        "runs Ray 2.59.0: build on rayproject/ray:2.59.0-py311-gpu [docker.ray-version]",
    ]


KEEP = "FROM rayproject/ray:2.60.0-py311-gpu\n"
DOCKER_RUNS = [
    # (id, the Dockerfile after FROM, the rule its one line breaks, or "" when it keeps Ray 2.60.0)
    ("constraint-copied-in", "COPY keep.txt /tmp/\nRUN pip install -c /tmp/keep.txt torch", ""),
    ("constraint-in-a-copied-folder", "COPY . /src\nWORKDIR /src\nRUN pip install -c keep.txt torch", ""),
    (
        "constraint-written-from-the-images-ray",
        "RUN python -c \"import ray; print('ray==' + ray.__version__)\" > /c.txt && pip install -c /c.txt torch",
        "",
    ),
    ("constraint-from-pip-freeze", "RUN pip freeze > /c.txt && python -m pip install --constraint=/c.txt torch", ""),
    ("ray-pinned-on-the-line", 'RUN uv pip install "ray[default]==2.60.0" torch', ""),
    ("only-pip-itself", "RUN pip install -U pip setuptools", ""),
    (
        "requirements-file-pinning-ray",
        "COPY keep.txt /app/requirements.txt\nRUN pip install -r /app/requirements.txt",
        "",
    ),
    (
        "a-base-without-ray-and-ray-pinned",
        "FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04\nRUN pip install ray==2.60.0",
        "",
    ),
    (
        "ray-in-another-command-of-the-run",
        "RUN python -c \"print('ray==2.60.0')\" && pip install torch",
        "docker.ray-constraint",
    ),
    ("constraint-of-another-command", "RUN python -c 'import ray' && pip install torch", "docker.ray-constraint"),
    (
        "constraint-without-ray",
        "COPY other.txt /tmp/\nRUN pip install -c /tmp/other.txt torch",
        "docker.ray-constraint",
    ),
    ("other-ray-pinned", 'RUN pip install "ray[default]==2.59.0"', "docker.ray-version"),
    ("constraint-pinning-other-ray", "COPY old.txt /tmp/\nRUN pip install -c /tmp/old.txt torch", "docker.ray-version"),
]


@pytest.mark.parametrize("name, body, rule", DOCKER_RUNS, ids=[d[0] for d in DOCKER_RUNS])
def test_each_pip_install_of_a_run_keeps_the_images_ray(tmp_path, name, body, rule):
    """A RUN is split into its shell commands: a pip install keeps Ray by its own pin or its own
    constraint file (copied in, or written from the image's Ray), not by a `ray==` or a `-c`
    elsewhere in the RUN."""
    from raylane.k8s import dockerfile

    (tmp_path / "keep.txt").write_text("ray==2.60.0\n")
    (tmp_path / "other.txt").write_text("numpy<3\n")
    (tmp_path / "old.txt").write_text("ray==2.59.0\n")
    path = tmp_path / "Dockerfile"
    path.write_text(("" if body.startswith("FROM") else KEEP) + body + "\n")
    found = [f.line() for f in dockerfile.check_dockerfile(path, "Dockerfile", "2.60.0")]
    if not rule:
        assert found == []
    else:
        assert len(found) == 1 and found[0].endswith(f"[{rule}]"), found


def test_the_drain_poll_the_checker_assumes_is_raylanes():
    """raylane.k8s.preemption cannot import raylane.onray.runtime (it imports Ray): its copy is compared here."""
    from raylane.k8s import preemption

    text = (REPO / "app" / "raylane" / "onray" / "runtime.py").read_text()
    assert f"DRAIN_POLL_S = {preemption.RAYLANE_DRAIN_POLL_S}" in text


def test_the_shipped_manifests_pass_once_their_placeholders_are_filled(tmp_path):
    """What `raylane k8s init` copies (docs/kubernetes.md's manifests, overlays rendered) fails
    only on what says CHANGE-ME (one line each, whichever overlays render it), and passes every
    layer once those are filled in."""
    if not any(check.MANIFESTS.rglob("*.yaml")):
        pytest.skip(f"no shipped manifests in {check.MANIFESTS} (they come with docs/kubernetes.md's change)")
    report = check_paths([str(check.MANIFESTS)], parser)
    lines = [f.line() for f in report.findings]
    assert len(lines) == 4 and all(line.endswith("[raylane.placeholder]") for line in lines), lines
    filled = tmp_path / "kit"
    check.init(str(filled))
    for path in filled.rglob("*.yaml"):
        path.write_text(path.read_text().replace("CHANGE-ME-", "acme-"))
    report = check_paths([str(filled)], parser)
    assert [f.line() for f in report.findings] == []
    assert report.checked > 0


def test_a_config_beside_the_manifest_and_a_secret_it_reads(tmp_path):
    """`raylane train my.yaml` reads my.yaml beside the manifest; an `env:` value `${HF_TOKEN}`
    needs HF_TOKEN in the driver's environment (here: the head container's, from a Secret)."""
    folder = tmp_path / "k8s"
    shutil.copytree(FIXTURE, folder)
    config = yaml.safe_load((REPO / "pipelines" / "gpt2-124m.yaml").read_text())
    (folder / "my.yaml").write_text(yaml.safe_dump({**config, "env": {"HF_TOKEN": "${HF_TOKEN}"}}))
    job = folder / "rayjob.yaml"
    job.write_text(job.read_text().replace("raylane train gpt2-124m ", "raylane train /app/my.yaml "))
    lines = run_check(folder)
    assert (
        len(lines) == 1
        and lines[0].endswith("[raylane.env-reference]")
        and "env.HF_TOKEN reads ${HF_TOKEN}" in lines[0]
    )
    doc = yaml.safe_load(job.read_text())
    doc["metadata"]["annotations"] = {"raylane.io/external": "Secret/hf"}  # made outside these files
    secret = {"secretKeyRef": {"name": "hf", "key": "token"}}
    cluster(doc)["headGroupSpec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "HF_TOKEN", "valueFrom": secret}
    ]
    job.write_text(yaml.safe_dump(doc))
    assert run_check(folder) == []


def test_a_kustomize_folder_without_kubectl_is_one_line(tmp_path, monkeypatch):
    from raylane.k8s import inputs

    (tmp_path / "kustomization.yaml").write_text("resources: []\n")
    monkeypatch.setattr(inputs, "KUBECTL", str(tmp_path / "no-kubectl"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"^kubectl not found \(at .*no-kubectl or on PATH\): it renders kustomization"
    ):
        check_paths([str(tmp_path)], parser)


def test_what_a_group_offers_is_what_the_autoscaler_reads(tmp_path):
    """A group's `resources` field declares an accelerator type and custom resources (and then
    is the only source of custom ones); the GPU count falls back to any `*gpu` limit."""
    from raylane.k8s.groups import ray_resources
    from raylane.k8s.model import PodGroup

    container = {"resources": {"limits": {"cpu": "500m", "amd.com/gpu": "2"}}}
    group = {"template": {"spec": {"containers": [container]}}, "rayStartParams": {"resources": '"{\\"efa\\": 4}"'}}
    assert ray_resources(PodGroup("g", "g", group)) == {"CPU": 1.0, "GPU": 2.0, "efa": 4.0}
    group["resources"] = {"CPU": "8", "accelerator_type:A10G": "1"}
    assert ray_resources(PodGroup("g", "g", group)) == {"CPU": 8.0, "GPU": 2.0, "accelerator_type:A10G": 1.0}

    def edit(d: Any) -> None:
        d["spec"]["entrypoint"] += " --set scaling.accelerator_type=A10G --set scaling.resources_per_worker.efa=1"
        for g in cluster(d)["workerGroupSpecs"]:
            g["resources"] = {"accelerator_type:A10G": "1", "efa": "4"}
            g["template"]["spec"]["containers"][0]["resources"]["limits"].pop("cpu")  # from requests then

    assert broken(tmp_path, "rayjob.yaml", edit) == []


def test_a_rayjob_on_the_raycluster_it_selects(tmp_path):
    """A RayJob with a clusterSelector is checked against the RayCluster of the same files it
    names (its GPUs, its head's environment); one on a cluster elsewhere skips what depends on it."""

    def on_cluster(workers: str, name: str = "raylane") -> Edit:
        def edit(d: Any) -> None:
            spec = job_spec(d)
            del spec["rayClusterSpec"]
            spec.update(clusterSelector={"ray.io/cluster": name}, backoffLimit=0)
            spec["entrypoint"] = spec["entrypoint"].replace(
                "scaling.num_workers=8,16", f"scaling.num_workers={workers}"
            )

        return edit

    assert broken(tmp_path / "a", "rayjob.yaml", on_cluster("8,16")) == []
    lines = broken(tmp_path / "b", "rayjob.yaml", on_cluster("8,32"))
    assert len(lines) == 1 and "more than the worker groups can ever hold (16:" in lines[0], lines
    assert broken(tmp_path / "c", "rayjob.yaml", on_cluster("8,32", "elsewhere")) == []
