"""The CLI's tool commands, beside the run commands of raylane.cli: `raylane stacks` (a live
run's ranks' stacks), `raylane k8s` (KubeRay manifests, checked offline) and `raylane slurm`
(the Slurm batch script). Each imports its work only when run."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def add_stacks(sub: Any) -> None:
    stacks = sub.add_parser("stacks", help="print the Python stack of every rank of a live run (on this host)")
    stacks.add_argument("run", help="the run's name (under --storage-path) or its folder")
    stacks.add_argument("--storage-path", default="runs", help="the run's run.storage_path (default: runs)")


def stacks(args: argparse.Namespace) -> int:
    from raylane.loop.observe.hangs import live_stacks, run_folder_of

    code, text = live_stacks(run_folder_of(args.run, args.storage_path))
    print(text, file=sys.stderr if code else sys.stdout, flush=True)
    return code


def add_k8s(sub: Any) -> None:
    """`k8s check` and `k8s init`: KubeRay manifests, checked offline (docs/k8s-check.md)."""
    k8s = sub.add_parser("k8s", help="check KubeRay manifests offline, or copy the shipped ones (docs/k8s-check.md)")
    verbs = k8s.add_subparsers(dest="k8s_command", required=True)
    check = verbs.add_parser(
        "check",
        help="validate manifests as the API server, the KubeRay operator and raylane would: exit 0 when all "
        "pass, else 2 and one line per broken rule",
    )
    check.add_argument(
        "paths",
        nargs="+",
        metavar="FILE_OR_DIR",
        help="YAML files (every document), folders (their YAML files and Dockerfiles) and kustomize folders "
        "(rendered with `kubectl kustomize`)",
    )
    init = verbs.add_parser("init", help="copy the shipped KubeRay manifests, Dockerfile and overlays into DIR")
    init.add_argument("dir", metavar="DIR", help="where to write them (made if missing; no file is overwritten)")


def k8s(args: argparse.Namespace, cli_parser: Any) -> int:
    """`cli_parser`: raylane's own, which the check parses a RayJob's entrypoint with."""
    from raylane import k8s as manifests

    if args.k8s_command == "init":
        written = manifests.init(args.dir)
        print(f"wrote {len(written)} files to {args.dir}; edit them, then: raylane k8s check {args.dir}", flush=True)
        return 0
    report = manifests.check_paths(args.paths, cli_parser)
    for finding in report.findings:
        print(finding.line(), flush=True)
    if report.findings:
        return 2
    print(report.summary(), flush=True)
    return 0


def add_slurm(sub: Any) -> None:
    """`slurm init`: the shipped Slurm batch script (docs/clusters.md#slurm)."""
    slurm = sub.add_parser("slurm", help="write the Slurm batch script that runs raylane on an allocation")
    verbs = slurm.add_subparsers(dest="slurm_command", required=True)
    init = verbs.add_parser("init", help="write slurm-ray.sbatch into DIR (a Ray cluster per job, then raylane train)")
    init.add_argument(
        "dir", nargs="?", default=".", metavar="DIR", help="where (default: here; no file is overwritten)"
    )


def slurm(args: argparse.Namespace) -> int:
    from raylane.clusters.slurm import init

    script = init(args.dir)
    print(f"wrote {script}; from your project: sbatch --nodes=2 {script} CONFIG [--set KEY=VALUE ...]", flush=True)
    return 0
