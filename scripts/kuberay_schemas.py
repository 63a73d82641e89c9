"""Regenerate the KubeRay CRD schemas `raylane k8s check` validates against.

Source: the KubeRay operator's published CRDs, ray-project/kuberay on GitHub,
`ray-operator/config/crd/bases/ray.io_rayjobs.yaml` and `ray.io_rayclusters.yaml`, at the tag of
the operator the docs name. The vendored copy in app/raylane/k8s/schemas/kuberay-1.7.0/ was made
from tag v1.7.0, commit 59d663aeec13760646da3db9c1cf8cfe883e30b7 ("yaml: bump to 1.7.0 (#5176)",
2026-08-19); its SOURCE.json records the tag, the commit and each CRD file's sha256.

What is kept: the `openAPIV3Schema` of each CRD's served `v1` version, less every `description`
(two thirds of the bytes; the checker's messages name fields, not their docs), written as compact
JSON, gzipped. Defaults, enums, patterns, `x-kubernetes-*` markers and the CEL rules
(`x-kubernetes-validations`) stay: the checker applies the defaults, makes the schema strict where
the API server is, and evaluates the CEL rules it knows (raylane.k8s.schema; a rule it does not
know fails tests/unit/test_k8s_check.py, so a refresh that brings a new one is noticed).

Refresh (e.g. for KubeRay v1.8.0), from a clone of the repository:

    git clone https://github.com/ray-project/kuberay && cd kuberay && git fetch --tags
    python scripts/kuberay_schemas.py --git-dir /path/to/kuberay/.git --ref v1.8.0

or from the two CRD files of a release (`--crd-dir DIR --ref v1.8.0 --commit SHA`). The output
folder is named for the tag (kuberay-1.8.0); point raylane.k8s.schema.KUBERAY_VERSION at it, run
`raylane k8s check` on the shipped manifests (app/raylane/k8s/kuberay/) and on KubeRay's own
samples (`ray-operator/config/samples/`) as a false-positive check, and port any new rule of
`ray-operator/controllers/ray/utils/validation.go` (raylane.k8s.operator).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

CRDS = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
CRD_DIR = "ray-operator/config/crd/bases"
OUT_ROOT = Path(__file__).resolve().parents[1] / "app" / "raylane" / "k8s" / "schemas"
VERSION = "v1"


def strip_descriptions(node: Any) -> Any:
    """The schema less its `description` strings (a property named `description` is kept: its
    value is a schema, not a string)."""
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def served_schema(crd: dict[str, Any], version: str = VERSION) -> dict[str, Any]:
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            if not entry.get("served"):
                raise SystemExit(f"{crd['metadata']['name']}: version {version} is not served")
            return entry["schema"]["openAPIV3Schema"]
    raise SystemExit(f"{crd['metadata']['name']}: no version {version}")


def read_crds(args: argparse.Namespace) -> dict[str, bytes]:
    """Each CRD file's bytes, from a git directory at a ref or from a folder."""
    found = {}
    for kind, name in CRDS.items():
        if args.git_dir:
            found[kind] = subprocess.run(
                ["git", "--git-dir", args.git_dir, "show", f"{args.ref}:{CRD_DIR}/{name}"],
                check=True,
                capture_output=True,
                timeout=60,
            ).stdout
        else:
            found[kind] = (Path(args.crd_dir) / name).read_bytes()
    return found


def commit_of(args: argparse.Namespace) -> str:
    if args.commit:
        return args.commit
    if not args.git_dir:
        raise SystemExit("--crd-dir needs --commit (the kuberay commit the files came from)")
    out = subprocess.run(
        ["git", "--git-dir", args.git_dir, "rev-parse", f"{args.ref}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--git-dir", help="a kuberay clone's git directory (read with `git show REF:path`)")
    where.add_argument("--crd-dir", help=f"a folder holding {' and '.join(CRDS.values())}")
    p.add_argument("--ref", required=True, help="the release tag, e.g. v1.7.0 (names the output folder)")
    p.add_argument("--commit", help="the commit of --crd-dir's files (found from --ref with --git-dir)")
    p.add_argument("--out-root", type=Path, default=OUT_ROOT)
    args = p.parse_args(argv)
    crds, commit = read_crds(args), commit_of(args)
    out = args.out_root / f"kuberay-{args.ref.lstrip('v')}"
    out.mkdir(parents=True, exist_ok=True)
    source: dict[str, Any] = {
        "repository": "https://github.com/ray-project/kuberay",
        "tag": args.ref,
        "commit": commit,
        "version": VERSION,
        "generated_by": "scripts/kuberay_schemas.py",
        "files": {},
    }
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for kind, data in crds.items():
        crd = yaml.load(data, Loader=loader)  # noqa: S506 - a safe loader, the C one when built
        if crd["spec"]["names"]["kind"] != kind:
            raise SystemExit(f"{CRDS[kind]}: holds kind {crd['spec']['names']['kind']}, expected {kind}")
        schema = strip_descriptions(served_schema(crd))
        text = json.dumps(schema, separators=(",", ":"), sort_keys=True).encode()
        target = out / f"{kind.lower()}.{VERSION}.json.gz"
        # mtime=0: the same CRD gives the same bytes, so a refresh shows only real changes.
        target.write_bytes(gzip.compress(text, compresslevel=9, mtime=0))
        source["files"][kind] = {
            "crd": f"{CRD_DIR}/{CRDS[kind]}",
            "crd_sha256": hashlib.sha256(data).hexdigest(),
            "schema": target.name,
            "json_bytes": len(text),
        }
        print(f"{target}: {len(text)} bytes of JSON, {target.stat().st_size} gzipped")
    (out / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
