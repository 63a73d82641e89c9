"""Slurm without Ray: the batch script raylane ships (package data, written out by `raylane slurm
init`), and the check its settings get before any node starts Ray. What runs on the nodes, with
Ray, is raylane.onray.slurm's.

Internal: not raylane's public API (see raylane.__all__); it may change in any release."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from raylane.config import ConfigError

SCRIPT = Path(__file__).resolve().parent / "slurm-ray.sbatch"  # package data; scripts/ links to it
PREFIX = "raylane slurm:"
# `ray start`'s defaults for --min-worker-port and --max-worker-port: every node hands its
# workers ports in this range, so a head's GCS port there may be taken by a worker of its own
# (Ray then fails with a traceback, seen at 16379).
RAY_WORKER_PORTS = (10002, 19999)
# The Ray node label each node carries: its Slurm node name (SLURMD_NODENAME), which a node's
# hostname need not be (NodeHostname), so that the wait names the node Slurm would.
NODE_LABEL = "raylane.io/slurm-node"
# The script's settings with a default (the script's own, written out in the line it prints).
DEFAULTS = {"RAYLANE_RAY_PORT": "6379", "RAYLANE_NODES_TIMEOUT_S": "300", "RAYLANE_JOIN_TIMEOUT_S": "60"}


def check_settings(environ: Mapping[str, str]) -> None:
    """The batch script's settings as the job has them: ConfigError naming the variable and its
    value for the first that cannot work, before any node starts Ray."""
    port = environ.get("RAYLANE_RAY_PORT") or DEFAULTS["RAYLANE_RAY_PORT"]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"RAYLANE_RAY_PORT = {port!r}: not a port (1-65535); the head's GCS port, 6379 by default")
    low, high = RAY_WORKER_PORTS
    if low <= int(port) <= high:
        raise ConfigError(
            f"RAYLANE_RAY_PORT = {port}: inside Ray's worker port range {low}-{high}, where each node's "
            "workers take their ports; choose one outside it (6379 by default)"
        )
    for name in ("RAYLANE_NODES_TIMEOUT_S", "RAYLANE_JOIN_TIMEOUT_S"):
        value = environ.get(name) or DEFAULTS[name]
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds < float("inf"):
            raise ConfigError(f"{name} = {value!r}: not a number of seconds above 0 ({DEFAULTS[name]} by default)")


def init(folder: str) -> Path:
    """Writes the shipped batch script into `folder` (made if missing), executable; ConfigError,
    writing nothing, when a file of that name is there already. Returns the file written."""
    if not SCRIPT.is_file():
        raise ConfigError(f"slurm init: this install has no shipped batch script ({SCRIPT} is missing)")
    target = Path(folder)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"slurm init: {folder} is a file, not a folder")
    dest = target / SCRIPT.name
    if dest.exists() or dest.is_symlink():
        raise ConfigError(f"slurm init: {dest} exists; nothing was written (move it, or choose another folder)")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(SCRIPT, dest)
    dest.chmod(0o755 & ~_umask())
    return dest


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
