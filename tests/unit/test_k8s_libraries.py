"""`raylane k8s check`'s plumbing is libraries' now (issue 61): Kubernetes' schemas from
kubernetes-validate, the CRDs' CEL rules by cel-python, the Dockerfile by dockerfile-parse, and a
port of Ray's quantity and group-resource parsing checked against Ray's own. Each library is
compared here with the hand-written code it replaced on the same inputs (the old code's answers
kept in this file), and what the libraries changed is pinned: the lines stay those the old
checker printed, and what it got wrong (a traceback, a binary quantity) is now right."""

from __future__ import annotations

import re
import shutil
import socket
from decimal import Decimal
from typing import Any

import pytest
import yaml

from raylane.cli import parser
from raylane.k8s import cel, check_paths, dockerfile, groups, plain, schema
from raylane.k8s.model import Obj, PodGroup
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "helpers" / "k8s"
MLFLOW = list(yaml.safe_load_all((FIXTURE / "mlflow.yaml").read_text()))
DEPLOYMENT, SERVICE = MLFLOW[0], MLFLOW[1]


def lines_of(raw: dict[str, Any]) -> list[str]:
    obj = Obj("f.yaml", 1, raw)
    schema.check_object(obj)
    return [f.line() for f in obj.findings]


def edited(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `doc` with the dotted `path` (list indexes as numbers) set to `value`."""
    out = yaml.safe_load(yaml.safe_dump(doc))
    node, *keys = [out, *(int(k) if k.isdigit() else k for k in path.split("."))]
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    return out


def container(path: str) -> str:
    return f"spec.template.spec.containers.0.{path}"


# -- kubernetes-validate: the plain kinds ---------------------------------------------------------

# The line the hand-written schemas of raylane.k8s.plain printed for each broken object (recorded
# on the old code); Kubernetes' schemas print the same.
STRICT = "the API server's strict field validation rejects it (with --validate=false it would be dropped silently)"
PLAIN_LINES = [
    (
        "service-type",
        edited(SERVICE, "spec.type", "Bogus"),
        "Service/mlflow: spec.type: 'Bogus' is not one of ClusterIP, NodePort, LoadBalancer, ExternalName [schema.enum]",
    ),
    (
        "service-protocol",
        edited(SERVICE, "spec.ports.0.protocol", "TCPX"),
        "Service/mlflow: spec.ports[0].protocol: 'TCPX' is not one of TCP, UDP, SCTP [schema.enum]",
    ),
    (
        "service-port-twice",  # a port without a protocol is TCP, as the API server defaults it
        edited(SERVICE, "spec.ports", [{"port": 80, "protocol": "TCP"}, {"port": 80, "name": "b"}]),
        "Service/mlflow: spec.ports[1]: duplicate entry (port=80, protocol='TCP'): the same as [0] [schema.duplicate]",
    ),
    (
        "service-target-port",
        edited(SERVICE, "spec.ports.0.targetPort", True),
        "Service/mlflow: spec.ports[0].targetPort: True is not an integer or a string [schema.anyOf]",
    ),
    (
        "deployment-quantity",
        edited(DEPLOYMENT, container("resources"), {"limits": {"memory": "170GB"}}),
        "Deployment/mlflow: spec.template.spec.containers[0].resources.limits.memory: '170GB' is not a quantity "
        "(e.g. 4, 500m, 170Gi, 1.5) [schema.pattern]",
    ),
    (
        "deployment-pod-field",
        edited(DEPLOYMENT, "spec.template.spec.tolerationz", []),
        f"Deployment/mlflow: spec.template.spec.tolerationz: unknown field (did you mean tolerations?): {STRICT} "
        "[schema.unknown-field]",
    ),
    (
        "deployment-strategy",
        edited(DEPLOYMENT, "spec.strategy", {"type": "Rolling"}),
        "Deployment/mlflow: spec.strategy.type: 'Rolling' is not one of Recreate, RollingUpdate [schema.enum]",
    ),
    (
        "deployment-env-value",
        edited(DEPLOYMENT, container("env"), [{"name": "A", "value": 1}]),
        "Deployment/mlflow: spec.template.spec.containers[0].env[0].value: 1 is not of type string [schema.type]",
    ),
    (
        "deployment-null-arg",  # a null in a list is no string (one in a map is pruned)
        edited(DEPLOYMENT, container("args.0"), None),
        "Deployment/mlflow: spec.template.spec.containers[0].args[0]: None is not of type string [schema.type]",
    ),
    (
        "deployment-container-port-twice",
        edited(DEPLOYMENT, container("ports"), [{"containerPort": 5000}, {"containerPort": 5000, "name": "b"}]),
        "Deployment/mlflow: spec.template.spec.containers[0].ports[1]: duplicate entry (containerPort=5000, "
        "protocol='TCP'): the same as [0] [schema.duplicate]",
    ),
    (
        "deployment-without-spec",
        {k: v for k, v in DEPLOYMENT.items() if k != "spec"},
        "Deployment/mlflow: spec: required field missing [schema.required]",
    ),
    (
        "owner-reference-without-uid",
        edited(SERVICE, "metadata.ownerReferences", [{"apiVersion": "v1", "kind": "X", "name": "x"}]),
        "Service/mlflow: metadata.ownerReferences[0].uid: required field missing [schema.required]",
    ),
    (
        "secret-data",
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "data": {"k": 1}},
        "Secret/s: data.k: 1 is not of type string [schema.type]",
    ),
    (
        "config-map-immutable",
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "immutable": "yes"},
        "ConfigMap/c: immutable: 'yes' is not of type boolean [schema.type]",
    ),
    (
        "namespace-finalizers",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "n"}, "spec": {"finalizers": "x"}},
        "Namespace/n: spec.finalizers: 'x' is not of type array [schema.type]",
    ),
    (
        "service-account-field",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "a"}, "imagePullSecret": []},
        f"ServiceAccount/a: imagePullSecret: unknown field (did you mean imagePullSecrets?): {STRICT} "
        "[schema.unknown-field]",
    ),
    (
        "rayjob-metadata-field",  # every object's metadata is Kubernetes' ObjectMeta
        edited(yaml.safe_load((FIXTURE / "rayjob.yaml").read_text()), "metadata.lables", {"a": "b"}),
        f"RayJob/gpt2-124m: metadata.lables: unknown field (did you mean labels?): {STRICT} [schema.unknown-field]",
    ),
]


@pytest.mark.parametrize("name, raw, line", PLAIN_LINES, ids=[p[0] for p in PLAIN_LINES])
def test_kubernetes_schemas_name_what_the_hand_written_ones_named(name, raw, line):
    assert lines_of(raw) == [f"f.yaml: {line}"]


def test_the_schemas_are_kubernetes_own_for_the_release_the_docs_name():
    """Kubernetes 1.32's strict schemas, read from the installed package (no network: every socket
    refused while the shipped set is checked)."""
    assert plain.schema_folder() == f"kubernetes-json-schema/v{plain.KUBERNETES_VERSION}.0-local-strict"
    assert f"Kubernetes {plain.KUBERNETES_VERSION}'s API" in (REPO / "docs" / "k8s-check.md").read_text()
    deployment = schema.schema_for("apps/v1", "Deployment")
    pod = deployment["properties"]["spec"]["properties"]["template"]["properties"]["spec"]
    # A field added after 1.32 (KubeRay 1.7.0's pod template has it) is not 1.32's.
    assert "schedulingGroup" not in pod["properties"] and "hostnameOverride" not in pod["properties"]
    assert "$ref" not in str(deployment)


def test_the_check_needs_no_network(monkeypatch):
    def refused(*args: Any, **kwargs: Any) -> None:
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "socket", refused)
    monkeypatch.setattr(socket, "create_connection", refused)
    for fresh in (plain.definitions, plain.kind_schema, plain.object_meta, schema.schema_for, schema.validator_for):
        fresh.cache_clear()  # read the package's files again, here
    schema.crd_schema.cache_clear()
    assert [f.line() for f in check_paths([str(FIXTURE)], parser).findings] == []


def test_metadata_that_is_no_mapping_is_one_line_not_a_traceback():
    """Labels or a selector written as a string: the old checker raised AttributeError out of
    `raylane k8s check` (a traceback, exit 1); now the type is the one line."""
    service = edited(SERVICE, "metadata.labels", "app-mlflow")
    assert lines_of(service) == [
        "f.yaml: Service/mlflow: metadata.labels: 'app-mlflow' is not of type object [schema.type]"
    ]
    deployment = edited(DEPLOYMENT, "spec.selector.matchLabels", "mlflow")
    assert lines_of(deployment) == [
        "f.yaml: Deployment/mlflow: spec.selector.matchLabels: 'mlflow' is not of type object [schema.type]"
    ]


# -- cel-python: the CRDs' CEL rules --------------------------------------------------------------

# The rules of KubeRay 1.7.0's CRDs as the old checker wrote them, in Python.
OLD_RULES = {
    "!(has(self.jobStatus) && has(self.jobDeploymentStatus))": lambda s: (
        not ("jobStatus" in s and "jobDeploymentStatus" in s)
    ),
    "has(self.jobStatus) || has(self.jobDeploymentStatus)": lambda s: "jobStatus" in s or "jobDeploymentStatus" in s,
    "!((has(self.onSuccess) || has(self.onFailure)) && has(self.deletionRules))": lambda s: (
        not (("onSuccess" in s or "onFailure" in s) and "deletionRules" in s)
    ),
    "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))": lambda s: (
        ("onSuccess" in s and "onFailure" in s) or "deletionRules" in s
    ),
    "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']": lambda s: (
        s in ("ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue")
    ),
}
FIELDS = ("jobStatus", "jobDeploymentStatus", "onSuccess", "onFailure", "deletionRules")


def test_cel_python_decides_every_rule_as_the_old_lambdas_did():
    assert schema.cel_rules() == {*OLD_RULES, "self == oldSelf"} and schema.unknown_cel_rules() == set()
    objects = [{f: {} for i, f in enumerate(FIELDS) if mask >> i & 1} for mask in range(2 ** len(FIELDS))]
    managers = ["ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue", "kueue", ""]
    for rule, old in OLD_RULES.items():
        for value in managers if rule.startswith("self in") else objects:
            assert cel.holds(rule, value) is old(value), (rule, value)
    assert cel.holds("self == oldSelf", {"a": 1})  # a transition rule: updates only


def test_a_rule_calling_a_kubernetes_cel_library_is_named_not_passed():
    """cel-python lacks Kubernetes' own CEL libraries: such a rule is reported by
    unknown_cel_rules (a schema refresh that brings one fails the suite), never evaluated."""
    for rule in ("isURL(self)", "self.split(',').size() == 2", "quantity(self).isLessThan(quantity('1'))"):
        assert cel.program(rule) is None, rule
    assert cel.program("self.size() > 0 && self.all(x, x.startsWith('a'))") is not None


# -- dockerfile-parse: the Dockerfile ---------------------------------------------------------------


def old_instructions(text: str) -> list[tuple[int, str, str]]:
    """The hand-written tokenizer dockerfile-parse replaced (raylane.k8s.dockerfile before)."""
    out: list[tuple[int, str, str]] = []
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if (not pending and (not stripped or stripped.startswith("#"))) or (pending and stripped.startswith("#")):
            continue
        start = start if pending else number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        word, _, rest = (pending + stripped).strip().partition(" ")
        pending = ""
        out.append((start, word.upper(), rest.strip()))
    return out


DOCKERFILES = [
    (REPO / "app" / "raylane" / "k8s" / "kuberay" / "Dockerfile").read_text(),
    (FIXTURE / "Dockerfile").read_text(),
    "FROM rayproject/ray:2.60.0-py311-gpu AS base\nRUN pip install \\\n    # torch's CUDA wheel\n    -c keep.txt torch\n"
    "FROM base\nworkdir /app\nCOPY --chown=ray keep.txt ./\nRUN pip check\n",
]


@pytest.mark.parametrize("text", DOCKERFILES, ids=["kit", "fixture", "stages"])
def test_dockerfile_parse_reads_the_instructions_the_old_tokenizer_read(text):
    def squeezed(value: str) -> str:
        return " ".join(value.split())

    new = [(s.line, s.word, squeezed(s.value)) for s in dockerfile.instructions(text)]
    assert new == [(line, word, squeezed(rest)) for line, word, rest in old_instructions(text)]


def test_args_and_quotes_are_read_as_docker_and_the_shell_read_them(tmp_path):
    """What the old substitution got wrong: an ARG declared before the first FROM reaches only
    the FROM lines (a RUN's `ray==${RAY}` is `ray==` in the build, no pin), a stage's own ARG and
    ENV reach its RUN, single quotes keep `$`, and the `escape` directive changes the
    continuation character."""
    path = tmp_path / "Dockerfile"
    path.write_text("ARG RAY=2.60.0\nFROM rayproject/ray:${RAY}-py311-gpu\nRUN pip install ray==${RAY} torch\n")
    found = [f.line() for f in dockerfile.check_dockerfile(path, "Dockerfile", "2.60.0")]
    assert len(found) == 1 and found[0].endswith("[docker.ray-constraint]"), found
    path.write_text(
        "FROM rayproject/ray:2.60.0-py311-gpu\nARG RAY=2.60.0\nENV TORCH=2.13.0\n"
        "RUN echo '$RAY' && pip install ray==${RAY} torch==$TORCH\n"
    )
    steps = dockerfile.instructions(path.read_text())
    assert steps[-1].shell() == "echo '$RAY' && pip install ray==2.60.0 torch==2.13.0"
    assert dockerfile.check_dockerfile(path, "Dockerfile", "2.60.0") == []
    text = "# escape=`\nFROM rayproject/ray:2.60.0-py311-gpu\nRUN pip install `\n    -c /c.txt torch\n"
    assert [(s.line, s.word, " ".join(s.value.split())) for s in dockerfile.instructions(text)][-1] == (
        3,
        "RUN",
        "pip install -c /c.txt torch",
    )
    assert re.search(r"\$\(date\)", dockerfile.Step(1, "RUN", "echo $(date) $HOME", {}, {}).shell())


# -- Ray's quantity and group-resource parsing -----------------------------------------------------

QUANTITIES = ["500Mi", "1.5", "2", "100m", "1Gi", "2Gi", "1e3", "1E3", "1k", "1K", "1Ki", "64Gi", "250u", "3n"]
QUANTITIES += ["1.5e3m", "+1", ".5", "4Ti", "2P", "1Ei", "0", 4, 1.5, "1ki", "Mi", "170GB", "x", ""]


@pytest.mark.parametrize("text", QUANTITIES, ids=[repr(q) for q in QUANTITIES])
def test_quantities_parse_as_rays_autoscaler_parses_them(text):
    """The port (raylane.k8s.groups) against Ray's own parse_quantity and its rounding up; the old
    port knew only m/k/M/G (500Mi, 1Gi, 1Ki, 250u were not quantities to it)."""
    from ray.autoscaler._private.kuberay import autoscaling_config, utils  # Ray's own, compared

    try:
        expected: Decimal | None = utils.parse_quantity(text)
    except ValueError:
        expected = None
    assert groups.exact(text) == expected
    if expected is not None:
        assert groups.rounded(text) == autoscaling_config._round_up_k8s_quantity(text)


GROUPS: list[dict[str, Any]] = [
    {"limits": {"cpu": "500m", "memory": "2Gi", "amd.com/gpu": "2"}},
    {"limits": {"cpu": "44", "memory": "170Gi", "nvidia.com/gpu": "4"}, "requests": {"cpu": "40"}},
    {"requests": {"cpu": "1500m", "memory": "1e9", "nvidia.com/gpu": "1"}},
    {"limits": {"cpu": "8", "google.com/tpu": "4"}},
    {"limits": {"cpu": "8", "nvidia.com/gpu": "0"}, "requests": {"nvidia.com/gpu": "1"}},
]
DECLARED: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({}, {}),
    ({"CPU": "8", "GPU": "2", "memory": "64Gi", "accelerator_type:A10G": "1", "efa": "4"}, {}),
    ({}, {"num-cpus": "4", "num-gpus": "2", "memory": "1000000", "resources": '"{\\"efa\\": 4, \\"TPU\\": 2}"'}),
    ({"TPU": "4", "hbm": "1Ki"}, {"num-cpus": "2"}),
]


@pytest.mark.parametrize("resources", GROUPS, ids=[f"pod{i}" for i in range(len(GROUPS))])
@pytest.mark.parametrize("declared, params", DECLARED, ids=[f"declared{i}" for i in range(len(DECLARED))])
def test_a_group_offers_what_rays_autoscaler_reads(resources, declared, params):
    """raylane.k8s.groups.ray_resources against Ray's _get_ray_resources_from_group_spec on the
    same worker group: CPU, GPU, TPU, memory and custom resources alike."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    spec: dict[str, Any] = {"groupName": "g", "template": {"spec": {"containers": [{"resources": resources}]}}}
    if declared:
        spec["resources"] = declared
    if params:
        spec["rayStartParams"] = params
    rays = {k: float(v) for k, v in _get_ray_resources_from_group_spec(spec, is_head=False).items()}
    assert groups.ray_resources(PodGroup("g", "g", spec)) == rays


def test_an_extended_resource_in_binary_units_is_its_limit(tmp_path):
    """A request of 1Ki and a limit of 1024 are one amount: the old port read 1Ki as no quantity
    and said the API server would refuse the pod (pod.extended-resource)."""
    folder = tmp_path / "k8s"
    shutil.copytree(FIXTURE, folder)
    job = folder / "rayjob.yaml"
    doc = yaml.safe_load(job.read_text())
    pod = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    pod["containers"][0]["resources"]["requests"]["example.com/fuse"] = "1Ki"
    pod["containers"][0]["resources"]["limits"]["example.com/fuse"] = "1024"
    job.write_text(yaml.safe_dump(doc))
    assert [f.line() for f in check_paths([str(folder)], parser).findings] == []
    pod["containers"][0]["resources"]["limits"]["example.com/fuse"] = "1k"
    job.write_text(yaml.safe_dump(doc))
    found = [f.line() for f in check_paths([str(folder)], parser).findings]
    assert len(found) == 1 and "example.com/fuse: requests 1Ki, limits 1k" in found[0], found
