"""Layer 5: the image's Dockerfile, read as text (no Docker daemon needed).

- The final stage's FROM, and any `pip install ray==X`, name the Ray raylane runs (the Ray
  installed here, which rayVersion and the images' tags name too: raylane.k8s.versions).
- No ENTRYPOINT or CMD: KubeRay starts `ray start --block` as the container's command, and an
  entrypoint of the image's own would wrap it, so that the pod's SIGTERM (Ray's drain notice)
  reaches a shell instead of `ray start`.
- Every `pip install` keeps Ray: the command itself pins `ray==X`, or names a `-c`/`--constraint`
  (or `-r`) file that does: a file beside the Dockerfile (copied in), or one an earlier command
  wrote from the image's own Ray (`python -c "import ray; print('ray==' + ray.__version__)" >
  FILE`). Else installing torch or raylane may replace the image's Ray with another version. Each
  RUN is split into its shell commands (quotes kept), so `python -c` or a `ray==` in another
  command of the same RUN keeps nothing. A constraint file that comes from the base image cannot
  be read here and is trusted.
The build itself (pip check, the import assert) runs only where a daemon is.

dockerfile-parse reads the file as Docker does (continuation lines, comments inside them, the
`escape` directive) and says which ARG and ENV values each instruction sees (an ARG declared
before the first FROM reaches only the FROM lines, unless a stage declares it again); its word
splitter substitutes them (Docker's own substitution in FROM, COPY, ADD, WORKDIR; the shell's in
a RUN, where a name not in scope is left as written: the base image's environment may hold it)."""

from __future__ import annotations

import io
import json
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dockerfile_parse import DockerfileParser
from dockerfile_parse.parser import image_from
from dockerfile_parse.util import WordSplitter

from raylane.k8s.model import Finding
from raylane.k8s.versions import image_parts, key, retagged, same, tag_version

OPERATORS = {"&&", "||", ";", "|", "&", ";;", "|&"}
REDIRECTS = {">", ">>", ">|", "&>", "&>>"}
# pip options that take a value (the next word, or after `=`), which is no requirement.
VALUED = set(
    "-c --constraint -r --requirement -i --index-url --extra-index-url -f --find-links -t --target --prefix --root "
    "--trusted-host --platform --python-version --implementation --abi --progress-bar --cache-dir --src -e "
    "--editable --config-settings -C --no-binary --only-binary --upgrade-strategy --log --python".split()
)
RAY_PIN = re.compile(r"^ray(\[[^\]]*\])?\s*==\s*v?(\d[\w.]*)$")
RAY_PIN_LINE = re.compile(r"(?m)^\s*ray(\[[^\]]*\])?\s*==\s*v?(\d[\w.]*)")
TOOLS = {"pip", "setuptools", "wheel", "uv"}  # installing only these leaves Ray alone


class InScope(dict[str, str]):
    """The values a RUN's shell sees; any other name stays as written (`${NAME}`, and the `$` of
    a `$(...)`), where WordSplitter would drop it."""

    def __contains__(self, name: object) -> bool:
        return True

    def __missing__(self, name: str) -> str:
        return f"${{{name}}}" if name else "$"


@dataclass(frozen=True)
class Step:
    """One instruction: its first line, its word, its arguments, the ARG and ENV values it sees."""

    line: int
    word: str
    value: str
    args: dict[str, str]
    envs: dict[str, str]

    def words(self) -> list[str]:
        """The arguments as Docker reads them (COPY, ADD, WORKDIR): the exec form's JSON list, or
        words substituted and unquoted."""
        if self.value.startswith("["):
            try:
                found = json.loads(self.value)
            except ValueError:
                found = None
            if isinstance(found, list):
                return [str(w) for w in found]
        return list(WordSplitter(self.value, args=self.args, envs=self.envs).split())

    def shell(self) -> str:
        """A RUN's text with the values in scope substituted, quotes kept for the shell's split."""
        scope = InScope({**self.args, **self.envs})
        return "".join(WordSplitter(self.value, envs=scope).split(maxsplit=0, dequote=False))


def instructions(text: str) -> list[Step]:
    """The Dockerfile's instructions, comments dropped; a FROM's value is its image with the
    ARGs before the first FROM substituted (and its stage name)."""
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    images = iter(parser.parent_images)
    out: list[Step] = []
    for step, context in zip(parser.structure, parser.context_structure, strict=True):
        word, value = step["instruction"], step["value"].strip()
        if word == "COMMENT":
            continue
        if word == "FROM":
            written, stage = image_from(value)
            if written is None:
                continue  # an empty FROM: no image, as if absent
            value = next(images) + (f" AS {stage}" if stage else "")
        out.append(Step(step["startline"] + 1, word, value, dict(context.args), dict(context.envs)))
    return out


def commands(run: str) -> list[list[str]]:
    """A RUN's shell text as its simple commands (words, quotes removed, redirections kept)."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: the shell would refuse it too; read it plainly
        tokens = run.split()
    out: list[list[str]] = [[]]
    for token in tokens:
        if token in OPERATORS:
            out.append([])
        else:
            out[-1].append(token)
    return [c for c in out if c]


def pip_install(words: list[str]) -> list[str] | None:
    """The arguments of a `pip install` (pip3, python -m pip, uv pip), None for another command."""
    for i, word in enumerate(words[1:], 1):
        if word != "install":
            continue
        before = words[:i]
        if re.fullmatch(r"pip(3(\.\d+)?)?", Path(before[-1]).name) or (
            len(before) >= 2 and Path(before[-2]).name == "uv" and before[-1] == "pip"
        ):
            return words[i + 1 :]
    return None


def pip_parts(args: list[str]) -> tuple[list[str], list[str]]:
    """(constraint and requirement files, requirements) of pip install's arguments."""
    files: list[str] = []
    wanted: list[str] = []
    i = 0
    while i < len(args):
        arg, value = args[i], None
        if arg.startswith("--") and "=" in arg:
            arg, value = arg.split("=", 1)
        elif arg in VALUED:
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        elif re.fullmatch(r"-[cr]\S+", arg):
            arg, value = arg[:2], arg[2:]
        elif not arg.startswith("-"):
            wanted.append(arg)
        if arg in ("-c", "--constraint", "-r", "--requirement") and value:
            files.append(value)
        i += 1
    return files, wanted


@dataclass
class Image:
    """What the Dockerfile has put where, so far: files copied in, files written by commands."""

    folder: Path  # the Dockerfile's folder, taken as the build context
    workdir: str = "/"
    copied: dict[str, str] = field(default_factory=dict)  # path in the image -> path in the context
    written: dict[str, str] = field(default_factory=dict)  # path in the image -> the command that wrote it

    def at(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.workdir, path))

    def copy(self, words: list[str]) -> None:
        if any(w.startswith("--from") for w in words):
            return  # from another stage or image: not in the context
        words = [w for w in words if not w.startswith("--")]  # --chown, --chmod, --link
        if len(words) < 2:
            return
        *sources, dest = words
        for source in sources:
            whole = source in (".", "./")
            into = not whole and (dest.endswith("/") or len(sources) > 1)
            self.copied[self.at(posixpath.join(dest, posixpath.basename(source)) if into else dest)] = source

    def local(self, path: str) -> Path | None:
        """The context's file that `path` in the image was copied from (or one of its name beside the Dockerfile)."""
        for dest, source in self.copied.items():
            if path == dest or path.startswith(dest.rstrip("/") + "/"):
                candidate = self.folder / source / path[len(dest) :].lstrip("/")
                if candidate.is_file():
                    return candidate
        beside = self.folder / posixpath.basename(path)
        return beside if beside.is_file() else None

    def ray_pin(self, path: str) -> tuple[bool, str | None]:
        """(keeps Ray, the version it pins if written out) for a constraint or requirements file."""
        path = self.at(path)
        if path in self.written:
            writer = self.written[path]
            found = RAY_PIN_LINE.search(writer)
            return bool(found) or "ray" in writer or "freeze" in writer, found.group(2) if found else None
        local = self.local(path)
        if local is None:
            return True, None  # from the base image, say: not readable here
        found = RAY_PIN_LINE.search(local.read_text(errors="replace"))
        return bool(found), found.group(2) if found else None


def check_dockerfile(path: Path, shown: str, here: str) -> list[Finding]:
    """The Dockerfile's broken rules against `here`, the Ray raylane runs."""
    try:
        steps = instructions(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        return [Finding(shown, "Dockerfile", "", "docker.read", f"cannot read it: {exc}")]
    out: list[Finding] = []

    def say(line: int, rule: str, message: str, merge: str = "") -> None:
        out.append(Finding(shown, "Dockerfile", f"line {line}", rule, message, merge))

    stages: dict[str, str] = {}  # stage name -> the image it starts from
    final_from: tuple[int, str] | None = None
    image = Image(path.parent)
    pinned = False
    for step in steps:
        line, word = step.line, step.word
        if word == "FROM":
            base, _, stage = step.value.partition(" AS ")
            if stage:
                stages[stage] = stages.get(base, base)
            final_from = (line, stages.get(base, base))  # FROM <an earlier stage>: its base
        elif word == "WORKDIR":
            image.workdir = image.at(" ".join(step.words()))
        elif word in ("COPY", "ADD"):
            image.copy(step.words())
        elif word in ("ENTRYPOINT", "CMD"):
            say(
                line,
                "docker.entrypoint",
                f"{word}: KubeRay runs `ray start` as the container's command; an {word} of the image's own keeps the pod's SIGTERM (the drain notice) from reaching it",
            )
        elif word == "RUN":
            for rule, message, merge in check_run(step.shell(), image, here):
                pinned |= merge.startswith("ray:") or rule == "pinned"
                if rule != "pinned":
                    say(line, rule, message, merge)
    if final_from is None:
        say(1, "docker.from", "no FROM")
    else:
        out += check_from(shown, *final_from, here, pinned)
    return out


def check_run(text: str, image: Image, here: str) -> list[tuple[str, str, str]]:
    """(rule, message, merge key) for each pip install of one RUN that does not keep Ray on `here`;
    ("pinned", "", "") where one pins it right. Files the commands write are noted as they go."""
    out: list[tuple[str, str, str]] = []
    for words in commands(text):
        redirect = [i for i, w in enumerate(words) if w in REDIRECTS and i + 1 < len(words)]
        for i in redirect:
            image.written[image.at(words[i + 1])] = " ".join(words[:i])
        args = pip_install(words[: redirect[0]] if redirect else words)
        if args is None:
            continue
        files, wanted = pip_parts(args)
        pins = [(m.group(2), f"it pins ray=={m.group(2)}") for r in wanted if (m := RAY_PIN.match(r.replace(" ", "")))]
        kept = bool(pins)
        for name in files:
            keeps, version = image.ray_pin(name)
            kept |= keeps
            if version:
                pins.append((version, f"its constraint file {name} pins ray=={version}"))
        for version, said in pins:
            if here and not same(version, here):
                message = f"pip install: {said}, but raylane runs Ray {here}: pin ray=={here}"
                out.append(("docker.ray-version", message, key(version)))
            else:
                out.append(("pinned", "", ""))
        if not kept and not (wanted and all(re.split(r"[<>=~!\[ ]", w)[0].lower() in TOOLS for w in wanted)):
            message = (
                "pip install without a constraint that pins ray (-c FILE with ray==X): it may replace the image's Ray"
            )
            out.append(("docker.ray-constraint", message, ""))
    return out


def check_from(shown: str, line: int, base: str, here: str, pinned: bool) -> list[Finding]:
    named = tag_version(base)
    if named is not None and here and not same(named, here):
        repo, tag, _ = image_parts(base)
        message = (
            f"FROM {base}: its tag names Ray {named}, but raylane runs Ray {here}: build on "
            f"{repo.rsplit('/', 1)[0] + '/' if '/' in repo else ''}{retagged(base, here)}"
        )
        return [Finding(shown, "Dockerfile", f"line {line}", "docker.ray-version", message, key(named))]
    if named is None and not pinned and here:
        message = f"FROM {base}: names no Ray version, and no pip install pins one: build on rayproject/ray:{here}-..."
        return [Finding(shown, "Dockerfile", f"line {line}", "docker.ray-version", message)]
    return []
