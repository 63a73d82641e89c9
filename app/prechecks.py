"""What can be checked before any work starts, beyond what one config field says about itself:
the files a command will write, the metric a sweep or checkpoint retention ranks by, and the
machine the workers land on.

The commands call these after the config validates and before Ray, torch's workers or MLflow
start, so that a mistake costs seconds, not a run whose results are then lost (a summary that
cannot be written after an hour of training). Each failure is one ConfigError naming the field
and the value; nothing here imports torch or Ray."""

from __future__ import annotations

import os
from pathlib import Path

from raylane import pipelines_ref
from raylane.config import BaseConfig, ConfigError, did_you_mean


def check_run(cfg: BaseConfig, *, summary_json: str | None = None, local_storage: bool = True) -> None:
    """A run's config and outputs. `local_storage`: `run.storage_path` is on this machine (not
    under `raylane submit`, whose job resolves it on the cluster)."""
    if summary_json:
        writable_file("--summary-json", summary_json)
    if local_storage and "://" not in cfg.run.storage_path:
        writable_dir("run.storage_path", cfg.run.storage_path)
    if cfg.checkpoint.keep_best:  # best_metric ranks checkpoints only then
        check_metric("checkpoint.best_metric", cfg.checkpoint.best_metric, cfg)


def check_metric(field: str, metric: str, cfg: BaseConfig) -> None:
    """`metric` is one the pipeline declares (BaseConfig.eval_metrics); anything goes when it
    declares none."""
    declared = cfg.eval_metrics()
    if declared is None or metric in declared:
        return
    hint = did_you_mean(metric, declared)
    raise ConfigError(f"{field} = {metric!r}: not a metric the {pipelines_ref.label(cfg.pipeline)} pipeline "
                      f"reports{hint}; it reports: {', '.join(declared)}")


def writable_file(field: str, path: str | Path) -> None:
    """A file can be written at `path`: its folder exists and is writable, and it is no folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{field} = {str(path)!r}: is a directory; name a file")
    folder = p.parent
    if not folder.is_dir():
        raise ConfigError(f"{field} = {str(path)!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{field} = {str(path)!r}: folder {str(folder)!r} is not writable")


def writable_dir(field: str, path: str | Path, value: str | None = None) -> None:
    """`path` is a writable folder, or one can be made there: its nearest existing ancestor is a
    writable folder. `value`: what the user typed, when `path` is derived from it."""
    shown = repr(value if value is not None else str(path))
    p = Path(path).expanduser().absolute()
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir():
        raise ConfigError(f"{field} = {shown}: {str(existing)!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{field} = {shown}: folder {str(existing)!r} is not writable")


def check_export(checkpoint: str, out: str) -> None:
    """`raylane export`'s arguments. A missing folder of `--out` is fine: export makes it (the
    user named where the file goes), after the checkpoint has loaded."""
    if not Path(checkpoint).is_dir():
        raise ConfigError(f"checkpoint = {checkpoint!r}: no such folder (expected runs/<name>/checkpoint_<step>)")
    target = Path(out).expanduser()
    if target.is_dir():
        raise ConfigError(f"--out = {out!r}: is a directory; name the file, e.g. {str(target / 'model.safetensors')!r}")
    writable_dir("--out", target.parent, out)


def oversubscription(cfg: BaseConfig, address: str | None) -> str | None:
    """A warning when a fresh embedded cluster (`address` None, as resolved by
    raylane.onray.localcluster.resolve_address) gets more worker CPUs than this machine has:
    Ray starts it with as many logical CPUs as asked, so the workers then share cores."""
    cores = os.cpu_count() or 1
    wanted = cfg.scaling.num_workers * cfg.scaling.cpus_per_worker
    if address is not None or wanted <= cores:
        return None
    return (f"warning: scaling.num_workers = {cfg.scaling.num_workers} x scaling.cpus_per_worker = "
            f"{cfg.scaling.cpus_per_worker:g} oversubscribes this machine's {cores} cores: "
            f"the workers will share them (slower, not wrong)")
