"""The top-level `env:` mapping: environment variables every rank gets. A value written `${NAME}`
is read from the driver's own environment when the run launches (`resolve`), so that a secret
reaches the ranks without being written into the config: the config, and so everything that
records it (MLflow's params, the run's record, a checkpoint's manifest, `raylane check`), keeps
the `${NAME}` form. Nothing here imports torch or Ray."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from raylane.errors import ConfigError

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
# What the launchers set for each rank themselves: a value from the config would break the group.
RESERVED = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "TORCHELASTIC_RUN_ID",
        # Replica groups' (fault_tolerance): the launcher tells each worker its group and the lighthouse.
        "TORCHFT_LIGHTHOUSE",
        "RAYLANE_REPLICA_GROUP",
        "RAYLANE_REPLICA_GROUPS",
    }
)


def check_entries(env: Mapping[str, Any]) -> dict[str, str]:
    """`env` as the config holds it (every value a string), or ValueError naming the entry."""
    out: dict[str, str] = {}
    for key, value in env.items():
        field = f"env.{key}"
        if not isinstance(key, str) or not NAME.match(key):
            raise ValueError(f"{field} = {value!r}: not an environment variable's name (letters, digits, _)")
        if key in RESERVED or key.startswith("RAY_"):
            raise ValueError(
                f"{field} = {value!r}: set by the launcher for each rank (or Ray's own setting), not by the config"
            )
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"{field} = {value!r}: expected a string (quote it in YAML)")
        text = str(value)
        if "${" in text and not REFERENCE.match(text):
            raise ValueError(
                f"{field} = {text!r}: only a whole value `${{NAME}}` is read from the driver's environment"
            )
        out[key] = text
    return out


def references(env: Mapping[str, str]) -> dict[str, str]:
    """key -> the driver's variable its value names, for the values written `${NAME}`."""
    return {k: m.group(1) for k, v in env.items() if (m := REFERENCE.match(v))}


def resolve(env: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables the ranks get: `env` with each `${NAME}` read from `environ` (this process's
    environment: the driver's); ConfigError naming the key when one is not set there."""
    environ = os.environ if environ is None else environ
    out = dict(env)
    for key, name in references(env).items():
        if name not in environ:
            raise ConfigError(
                f"env.{key} = '${{{name}}}': {name} is not set in the driver's environment "
                f"(export it where the run is launched)"
            )
        out[key] = environ[name]
    return out


def apply_here(env: Mapping[str, str]) -> None:
    """A torchrun rank or a `--local` run: the ranks are this process, so `env:` is its own
    environment (each `${NAME}` read from it), set before its process group starts."""
    os.environ.update(resolve(env))
