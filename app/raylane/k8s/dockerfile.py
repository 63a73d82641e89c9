"""Layer 5: the image's Dockerfile, read as text (no Docker daemon needed).

- The final stage's FROM names the Ray version the manifests' rayVersion names (and the Ray here).
- No ENTRYPOINT or CMD: KubeRay starts `ray start --block` as the container's command, and an
  entrypoint of the image's own would wrap it, so that the pod's SIGTERM (Ray's drain notice)
  reaches a shell instead of `ray start`.
- Every `pip install` keeps Ray: a `-c`/`--constraint` file that pins ray (or `ray==` on the line),
  else installing torch or raylane may replace the image's Ray with another version.
The build itself (pip check, the import assert) runs only where a daemon is."""

from __future__ import annotations

import re
from pathlib import Path

from raylane.k8s.model import Finding

Rule = tuple[str, str, str]
VERSION = re.compile(r"(\d+\.\d+\.\d+)")


def instructions(text: str) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[int, str, str]] = []
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        start = start if pending else number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((start, word.upper(), rest.strip()))
    return out


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def check_dockerfile(path: Path, shown: str, ray_versions: set[str]) -> list[Finding]:
    """The Dockerfile's broken rules against the Ray versions the manifests name."""
    try:
        steps = instructions(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        return [Finding(shown, "Dockerfile", "", "docker.read", f"cannot read it: {exc}")]
    out: list[Finding] = []

    def say(line: int, rule: str, message: str) -> None:
        out.append(Finding(shown, "Dockerfile", f"line {line}", rule, message))

    args: dict[str, str] = {}
    stages: dict[str, str] = {}  # stage name -> the image it starts from
    final_from: tuple[int, str] | None = None
    for line, word, rest in steps:
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key.strip()] = value.strip().strip('"')
        elif word == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]  # --platform=...
            image = substitute(words[0], args) if words else ""
            if len(words) >= 3 and words[1].upper() == "AS":
                stages[words[2]] = stages.get(image, image)
            final_from = (line, stages.get(image, image))  # FROM <an earlier stage>: its base
        elif word in ("ENTRYPOINT", "CMD"):
            say(
                line,
                "docker.entrypoint",
                f"{word}: KubeRay runs `ray start` as the container's command; an {word} of the image's own keeps the pod's SIGTERM (the drain notice) from reaching it",
            )
        elif word == "RUN" and re.search(r"\bpip3?\s+install\b|\buv\s+pip\s+install\b", rest):
            if not keeps_ray(substitute(rest, args), path.parent):
                say(
                    line,
                    "docker.ray-constraint",
                    "pip install without a constraint that pins ray (-c FILE with ray==X): it may replace the image's Ray",
                )
    if final_from is None:
        say(1, "docker.from", "no FROM")
        return out
    line, image = final_from
    found = VERSION.search(image.rsplit("/", 1)[-1].partition(":")[2])
    for wanted in sorted(ray_versions):
        if found is None or found.group(1) != wanted:
            named = found.group(1) if found else "no version"
            say(
                line,
                "docker.ray-version",
                f"FROM {image}: its tag names Ray {named}, the manifests' rayVersion is {wanted}",
            )
    return out


def keeps_ray(command: str, folder: Path) -> bool:
    """A pip install line pins ray directly or through a constraint file that does."""
    if re.search(r"\bray(\[[^\]]*\])?==", command):
        return True
    for name in re.findall(r"(?:-c|--constraint)[ =]+(\S+)", command):
        local = folder / Path(name).name
        if not local.is_file():
            return True  # made inside the image: trust it
        if re.search(r"^\s*ray(\[[^\]]*\])?==", local.read_text(), re.M):
            return True
    return False
