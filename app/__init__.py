"""raylane: distributed PyTorch training on Ray (DDP/FSDP workers, Tune sweeps, MLflow tracking)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("raylane")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"


def submit(config, overrides=(), **options):
    """Submit `raylane train CONFIG` as a Ray job; returns a handle with status(), logs(),
    follow(), wait(), stop() and mlflow_run_id(). See `raylane.onray.jobs.submit` (imports Ray lazily)."""
    from raylane.onray.jobs import submit as _submit

    return _submit(config, overrides, **options)
