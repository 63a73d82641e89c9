"""KubeRay, checked offline: `raylane k8s check FILE_OR_DIR...` validates a raylane deployment's
manifests as the API server and the KubeRay operator would, and as raylane will read them, before
anything reaches a cluster (docs/k8s-check.md lists every rule and where it comes from):

1. `schema`: each object against its schema, as the API server does (KubeRay's CRD schemas,
   vendored under schemas/ by scripts/kuberay_schemas.py; nulls pruned, defaults applied, strict).
2. `operator`: the KubeRay operator's own rules (validation.go), which no schema holds.
3. `entrypoint` and `fit`: raylane's side (the entrypoint parses with raylane's parser and config
   loader and needs no shell quoting, storage, GPUs, MLflow's allowed hosts, one Ray version,
   the preemption drain window).
4. `plain`: the plain Kubernetes objects (Deployment, Service, ServiceAccount, Secret, ConfigMap).
5. `dockerfile`: the image's Dockerfile, as text.

`raylane k8s init DIR` copies the shipped manifests (the package data under kuberay/) to DIR.
Nothing here imports torch or Ray."""

from raylane.k8s.check import Report, check_paths, init
from raylane.k8s.model import Finding

__all__ = ["Finding", "Report", "check_paths", "init"]
