"""Layer 3, first half: a RayJob's `entrypoint` as raylane will read it on the head.

In K8sJobMode the string is word-split by a shell twice (the submitter's `bash -ce "... ray job
submit -- <entrypoint>"`, then the job supervisor's shell), so any character a shell treats
specially is a trap: `--set scaling.num_workers=[8,16]` is a glob. What is left is parsed by
raylane's own argument parser (handed in by the CLI, which this package may not import) and its
config loader, the same checks `raylane submit` makes before it uploads anything: a misspelled
flag or key fails here, not on the head after the GPU nodes were provisioned."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raylane.config import BaseConfig, ConfigError
from raylane.k8s.model import get

# What bash treats specially in a word (globs, quotes, expansions, redirections, lists, comments).
SHELL_SPECIAL = set("[]*?{}$`'\"\\;|&<>()!#~\n")
RUN_COMMANDS = ("train", "tune", "autotune")
# A user's pipeline is imported to check its config, as on the head; in CI that means installed.
PIPELINE_HINT = (
    "; the check loads the config as the head will, so the pipeline's code must be importable where `raylane k8s "
    "check` runs (in CI: pip install the package that holds it, or run the check from the folder that holds the module)"
)
ParserFactory = Callable[[], argparse.ArgumentParser]
Rule = tuple[str, str, str]


@dataclass
class Job:
    """What a RayJob asks raylane to do: its command line, parsed, and the config it names."""

    argv: list[str]
    args: argparse.Namespace | None = None
    cfg: BaseConfig | None = None
    rules: list[Rule] = field(default_factory=list)
    is_raylane: bool = True


def runtime_env(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The RayJob's runtimeEnvYAML as a mapping ({} when unset), None when it is not one (the
    operator layer names that)."""
    try:
        parsed = yaml.safe_load(spec.get("runtimeEnvYAML") or "") or {}
    except yaml.YAMLError:
        return None
    return parsed if isinstance(parsed, dict) else None


def shell_trap(entrypoint: str) -> str | None:
    """The first word holding a character a shell would act on, or None."""
    for word in re.split(r"[ \t]+", entrypoint):  # a newline is no separator: it ends the command
        if set(word) & SHELL_SPECIAL:
            return word
    return None


def raylane_argv(words: list[str]) -> list[str] | None:
    """The arguments after `raylane` (or `python -m raylane`), or None for another program."""
    if words[:1] == ["raylane"]:
        return words[1:]
    if len(words) >= 3 and Path(words[0]).name.startswith("python") and words[1:3] == ["-m", "raylane"]:
        return words[3:]
    return None


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    """argparse's verdict without its exit: (args, "") or (None, its error line)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(argv), ""
        except SystemExit:
            lines = err.getvalue().strip().splitlines()
            return None, (lines[-1] if lines else "not a valid command line")


def read_entrypoint(body: dict[str, Any], parser: ParserFactory, folder: str) -> Job | None:
    """The RayJob's raylane command, parsed and its config loaded; None when it has no entrypoint."""
    spec = body.get("spec") or {}
    text = spec.get("entrypoint")
    if not isinstance(text, str) or not text.strip():
        if spec.get("submissionMode", "K8sJobMode") != "InteractiveMode":
            return Job([], rules=[("spec.entrypoint", "raylane.entrypoint", "missing: the job has nothing to run")])
        return None
    trap = shell_trap(text.strip())
    if trap is not None:
        message = (
            f"{trap!r} holds a character a shell acts on, and K8sJobMode word-splits the entrypoint in a "
            "shell twice: write it without quotes, brackets, globs or $ (e.g. scaling.num_workers=8,16)"
        )
        return Job(text.split(), rules=[("spec.entrypoint", "raylane.entrypoint-quoting", message)])
    words = text.split()
    argv = raylane_argv(words)
    if argv is None:
        return Job(words, is_raylane=False)
    job = Job(argv)
    args, error = parse_args(parser(), argv)
    if args is None:
        job.rules.append(("spec.entrypoint", "raylane.entrypoint-args", f"raylane rejects it: {error}"))
        return job
    job.args = args
    if args.command not in RUN_COMMANDS:
        job.rules.append(
            (
                "spec.entrypoint",
                "raylane.entrypoint-command",
                f"`raylane {args.command}`: a RayJob runs one of {', '.join(RUN_COMMANDS)}",
            )
        )
        return job
    if getattr(args, "address", None) or getattr(args, "local", False):
        flag = "--address" if getattr(args, "address", None) else "--local"
        message = f"{flag}: give none; the job supervisor sets RAY_ADDRESS to the RayJob's own cluster"
        job.rules.append(("spec.entrypoint", "raylane.entrypoint-address", message))
    job.cfg = load(args, folder, job.rules)
    return job


def config_source(config: str, folder: str) -> str | None:
    """Where the named config is read from here: beside the manifest, from the working
    directory, a copy of its file beside the manifest, or a shipped config's name; None when
    none of these has it."""
    from raylane.config import shipped_configs

    # A config baked into the image (/app/my.yaml) is read from a copy beside the manifest.
    for candidate in (Path(folder) / config, Path(config), Path(folder) / Path(config).name):
        if candidate.is_file():
            return str(candidate)
    return config if config in shipped_configs() else None


def load(args: argparse.Namespace, folder: str, rules: list[Rule]) -> BaseConfig | None:
    """The validated config of the command (as `raylane submit` checks it before uploading), or
    None with a rule naming what is wrong."""
    source = config_source(args.config, folder)
    if source is None:
        message = (
            f"config {args.config!r}: not a shipped config and no such file beside the manifest or in the "
            "working directory, so raylane's checks of it cannot run here"
        )
        rules.append(("spec.entrypoint", "raylane.config", message))
        return None
    try:
        if args.command == "tune":
            from raylane.config.sweep import load_sweep

            return load_sweep(source, args.overrides)[1]
        if args.command == "autotune":
            from raylane.config import autotune

            return autotune.load(source, args.overrides)[1]
        from raylane.api import prepare_submit

        return prepare_submit(source, args.overrides)
    except ConfigError as exc:
        rules.append(
            ("spec.entrypoint", "raylane.config", str(exc) + (PIPELINE_HINT if "unknown pipeline" in str(exc) else ""))
        )
    except Exception as exc:  # noqa: BLE001 - a user pipeline that does not import here: one line
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        hint = PIPELINE_HINT if isinstance(exc, ImportError) else ""
        rules.append(
            (
                "spec.entrypoint",
                "raylane.config",
                f"loading {args.config!r} failed: {type(exc).__name__}: {first}{hint}",
            )
        )
    return None


def driver_env(body: dict[str, Any]) -> dict[str, str | None]:
    """The driver's environment as the manifest sets it: the head container's variables, then the
    runtime env's env_vars over them (a value from a Secret or field reads None)."""
    env: dict[str, str | None] = {}
    prefix = "spec.rayClusterSpec" if body.get("kind") == "RayJob" else "spec"
    spec = get(body, *prefix.split("."), default={}) or {}
    head = get(spec, "headGroupSpec", "template", "spec", "containers", 0, default={}) or {}
    for var in head.get("env") or []:
        if isinstance(var, dict) and "name" in var:
            env[str(var["name"])] = None if "valueFrom" in var else str(var.get("value", ""))
    if body.get("kind") == "RayJob":
        for key, value in ((runtime_env(body.get("spec") or {}) or {}).get("env_vars") or {}).items():
            env[str(key)] = None if value is None else str(value)
    return env
