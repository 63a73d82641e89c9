"""What `raylane k8s check` reads: YAML files (every document of each), folders, and kustomize
folders (a folder with a kustomization.yaml is rendered with `kubectl kustomize`, which needs no
cluster), and the Dockerfiles beside them.

Objects are grouped in sets, one deployment each: the loose files named (or found in plain
folders) form one set, each rendered kustomization another. The checks that span objects (the
MLflow server's allowed hosts, a RayJob and the Service it reaches) look inside one set."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from raylane.errors import ConfigError
from raylane.k8s.model import Obj

KUSTOMIZATION = ("kustomization.yaml", "kustomization.yml", "Kustomization")
YAML_SUFFIXES = (".yaml", ".yml")
KUSTOMIZE_TIMEOUT_S = 60.0
KUBECTL = "/usr/bin/kubectl"  # where Debian's package puts it; else the one on PATH
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass
class ObjectSet:
    """The objects of one deployment, and the Dockerfiles that build its image."""

    name: str
    objects: list[Obj] = field(default_factory=list)
    dockerfiles: list[Path] = field(default_factory=list)


def shown(path: Path) -> str:
    """A path as the user would write it: relative to the working directory when under it."""
    try:
        return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd().resolve()) else str(path)
    except ValueError:  # another drive
        return str(path)


def is_dockerfile(path: Path) -> bool:
    if path.name.endswith((".dockerignore", ".md")):
        return False
    return path.name == "Dockerfile" or path.name.startswith("Dockerfile.") or path.suffix == ".Dockerfile"


def documents(text: str, source: str, folder: str) -> list[Obj]:
    """Every non-empty document of a multi-document YAML text, or ConfigError on bad YAML."""
    try:
        docs = list(yaml.load_all(text, Loader=Loader))  # noqa: S506 - a safe loader, the C one when built
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    out = []
    for i, doc in enumerate(docs, 1):
        if doc is None:
            continue
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            out += [Obj(source, i, item, folder) for item in doc["items"]]  # `kubectl get -o yaml`'s form
        else:
            out.append(Obj(source, i, doc, folder))
    return out


def read_file(path: Path) -> list[Obj]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{shown(path)}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    return documents(text, shown(path), str(path.resolve().parent))


def kubectl() -> str:
    found = KUBECTL if os.access(KUBECTL, os.X_OK) else shutil.which("kubectl")
    if not found:
        raise ConfigError(
            f"kubectl not found (at {KUBECTL} or on PATH): it renders kustomization folders "
            "(`kubectl kustomize`, no cluster needed); install it, or check the rendered YAML instead"
        )
    return found


ORIGIN = "config.kubernetes.io/origin"


def render(folder: Path) -> list[Obj]:
    """`kubectl kustomize FOLDER`'s objects (offline: kustomize reads only the folder's files),
    each named by the file it came from. kustomize says which when asked (buildMetadata:
    originAnnotations), which a kustomization of our own around FOLDER does, so that the
    user's files stay as they are."""
    with tempfile.TemporaryDirectory(prefix="raylane-k8s-") as wrap:
        rel = os.path.relpath(folder.resolve(), wrap)  # kustomize refuses an absolute root
        Path(wrap, "kustomization.yaml").write_text(
            yaml.safe_dump({"resources": [rel], "buildMetadata": ["originAnnotations"]})
        )
        try:
            done = subprocess.run(
                [kubectl(), "kustomize", wrap], capture_output=True, text=True, timeout=KUSTOMIZE_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise ConfigError(f"{shown(folder)}: `kubectl kustomize` took over {KUSTOMIZE_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[-1].replace(wrap, "...")
            raise ConfigError(f"{shown(folder)}: `kubectl kustomize` failed: {first}")
        objects = documents(done.stdout, f"{shown(folder)} (kustomize)", str(folder.resolve()))
        for obj in objects:
            origin = take_origin(obj)
            if origin is not None:
                path = (Path(wrap) / origin).resolve()
                through = "" if path.parent == folder.resolve() else f" via {shown(folder)}"
                obj.source, obj.folder = f"{shown(path)}{through}", str(path.parent)
    return objects


def take_origin(obj: Obj) -> str | None:
    """The origin annotation's file (removed: it is ours, not the user's), or None."""
    annotations = obj.raw.get("metadata", {}).get("annotations") if isinstance(obj.raw, dict) else None
    if not isinstance(annotations, dict) or ORIGIN not in annotations:
        return None
    origin = yaml.safe_load(annotations.pop(ORIGIN) or "") or {}
    if not annotations:
        del obj.raw["metadata"]["annotations"]
    path = origin.get("path") if isinstance(origin, dict) else None
    return path if isinstance(path, str) and not origin.get("repo") else None


def kustomize_roots(folder: Path) -> list[Path]:
    """The folders under `folder` (itself included) that hold a kustomization."""
    return sorted(p.parent for name in KUSTOMIZATION for p in folder.rglob(name))


def gather(paths: list[str]) -> list[ObjectSet]:
    """The object sets the named files and folders hold (ConfigError for a path that is not there)."""
    loose = ObjectSet("files")
    sets: list[ObjectSet] = []
    dockerfiles: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_file():
            if is_dockerfile(path):
                dockerfiles.append(path)
            else:
                loose.objects += read_file(path)
            continue
        if not path.is_dir():
            raise ConfigError(f"{name}: no such file or folder")
        roots = kustomize_roots(path)
        for root in roots:
            sets.append(ObjectSet(f"{shown(root)} (kustomize)", render(root)))
        for found in sorted(p for p in path.rglob("*") if p.is_file()):
            if is_dockerfile(found):
                dockerfiles.append(found)
            elif found.suffix in YAML_SUFFIXES and not any(found.is_relative_to(r) for r in roots):
                loose.objects += read_file(found)  # a kustomization's own files are its patches' inputs
    if loose.objects:
        sets.insert(0, loose)
    for one in sets or [loose]:
        one.dockerfiles = dockerfiles
    return sets or [loose]
