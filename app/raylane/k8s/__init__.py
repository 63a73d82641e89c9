"""KubeRay, checked offline: `raylane k8s check FILE_OR_DIR...` validates a raylane deployment's
manifests as the API server and the KubeRay operator would, and as raylane will read them, before
anything reaches a cluster (docs/k8s-check.md lists every rule and where it comes from):

1. `schema`: each object against its schema, as the API server does (KubeRay's CRD schemas,
   vendored under schemas/ by scripts/kuberay_schemas.py; nulls pruned, defaults applied, strict).
2. `operator`: the KubeRay operator's own rules (validation.go), which no schema holds;
   `pods`: what the API server checks of a pod's extended resources (GPUs: request = limit);
   `refs`: every Secret, ConfigMap, ServiceAccount and claim a pod names is in the files (or
   declared made elsewhere).
3. `entrypoint` and `fit`: raylane's side (the entrypoint parses with raylane's parser and config
   loader and needs no shell quoting, storage, GPUs); `mlflow` (the tracking URI reaches a server
   that allows it), `versions` (one Ray version: the one installed here), `preemption` (the drain
   window, and the spot platforms' limits on it), `refs` (every pod's identity for the bucket).
4. `plain`: the plain Kubernetes objects (Deployment, Service, ServiceAccount, Secret, ConfigMap).
5. `dockerfile`: the image's Dockerfile, as text.

Every string still holding the kit's CHANGE-ME fails. Findings of one wrong Ray version, or of
one rule and message through several overlays, print as one line (check.merged).

`raylane k8s init DIR` copies the shipped manifests (the package data under kuberay/) to DIR.
Nothing here imports torch or Ray."""

from raylane.k8s.check import Report, check_paths, init
from raylane.k8s.model import Finding

__all__ = ["Finding", "Report", "check_paths", "init"]
