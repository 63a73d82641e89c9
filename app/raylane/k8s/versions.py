"""One Ray version everywhere: the Ray installed beside raylane (raylane pins it, and the client's
`raylane submit` refuses a cluster on another) is the one rayVersion, every Ray image's tag and the
Dockerfile must name. Each place that names another version is a finding keyed by that version,
so that a kit on the wrong Ray prints one line per wrong version (raylane.k8s.check.merged), with
the one right advice: build and tag for the Ray raylane runs.

An image pinned by digest alone (`repo@sha256:...`) cannot be read here (no registry is asked):
keep the tag beside the digest (`repo:0.1.0-ray2.60.0-cu12@sha256:...`, which Kubernetes pulls by
the digest; kustomize writes it from `images:` with both `newTag` and `digest`), else it fails."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from importlib import metadata
from typing import Any

from raylane.k8s.model import PodGroup
from raylane.k8s.operator import ray_version

Keyed = tuple[str, str, str, str]  # (field path, rule, message, merge key)
RAY_IN_TAG = re.compile(r"ray-?v?(\d+\.\d+(?:\.\d+)?)")
LEADING_VERSION = re.compile(r"v?(\d+\.\d+(?:\.\d+)?)")


@functools.cache
def installed_ray() -> str | None:
    try:
        return metadata.version("ray")
    except metadata.PackageNotFoundError:
        return None


def same(a: str, b: str) -> bool:
    return ray_version(a) == ray_version(b)


def key(version: str) -> str:
    parsed = ray_version(version)
    return "ray:" + (".".join(map(str, parsed)) if parsed else version)


def image_parts(image: str) -> tuple[str, str, str]:
    """(repository, tag, digest) of an image reference; "" for a part it lacks."""
    rest, _, digest = image.partition("@")
    repo, _, tag = rest.rpartition(":") if ":" in rest.rsplit("/", 1)[-1] else (rest, "", "")
    return repo, tag, digest


def tag_version(image: str) -> str | None:
    """The Ray version an image's tag names: `ray2.60.0` anywhere in it (raylane:0.1.0-ray2.60.0-cu12),
    or the tag's leading version for Ray's own images (rayproject/ray:2.60.0-py311-gpu)."""
    repo, tag, _ = image_parts(image)
    found = RAY_IN_TAG.search(tag)
    if found is None and repo.rsplit("/", 1)[-1] in ("ray", "ray-ml", "ray-llm"):
        found = LEADING_VERSION.match(tag)
    return found.group(1) if found else None


def retagged(image: str, here: str) -> str:
    """The image's name as it should read, its Ray version (or none) made `here`."""
    repo, tag, _ = image_parts(image)
    short = repo.rsplit("/", 1)[-1]
    if tag and (version := tag_version(image)):
        return f"{short}:{tag.replace(version, here, 1)}"
    return f"{short}:<version>-ray{here}"


def wanted_ray(spec: dict[str, Any]) -> str:
    return str(installed_ray() or spec.get("rayVersion") or "")


def check_versions(prefix: str, spec: dict[str, Any], groups: list[PodGroup]) -> Iterator[Keyed]:
    """rayVersion is the Ray installed here, and every Ray image's tag names it."""
    wanted, here = spec.get("rayVersion"), wanted_ray(spec)
    if not wanted:
        yield (
            f"{prefix}.rayVersion",
            "raylane.ray-version",
            f"not set: write the Ray version the image holds ({here})",
            "",
        )
    elif installed_ray() and not same(str(wanted), here):
        yield (
            f"{prefix}.rayVersion",
            "raylane.ray-version",
            (
                f"{str(wanted)!r}: raylane runs Ray {here} (installed here; raylane pins it, and the image and the "
                f'client must run the same): write rayVersion: "{here}" and build the image on Ray {here}'
            ),
            key(str(wanted)),
        )
    for g in groups:
        yield from check_image(g, here)


def check_image(g: PodGroup, here: str) -> Iterator[Keyed]:
    image = str(g.ray_container.get("image") or "")
    if not here or not image:
        return
    where = f"{g.path}.template.spec.containers[0].image"
    named = tag_version(image)
    if named is not None and same(named, here):
        return
    if named is not None:
        message = (
            f"{image!r}: its tag names Ray {named}, but raylane runs Ray {here}: build it on Ray {here} and tag it "
            f"so ({retagged(image, here)})"
        )
        yield where, "raylane.image-tag", message, key(named)
    elif image_parts(image)[2]:
        message = (
            f"{image!r}: pinned by digest alone, so the Ray it holds cannot be read here: keep the tag that names "
            f"Ray {here} beside the digest ({retagged(image, here)}@sha256:...; kustomize images: newTag and digest)"
        )
        yield where, "raylane.image-tag", message, f"image:{image}"
    else:
        message = (
            f"{image!r}: its tag names no Ray version: tag images with the Ray they hold ({retagged(image, here)}), "
            "so that a cluster on another Ray is seen here, not on the GPU nodes"
        )
        yield where, "raylane.image-tag", message, f"image:{image}"
