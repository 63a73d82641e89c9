"""raylane: distributed PyTorch training on Ray (DDP/FSDP workers, Tune sweeps, MLflow tracking)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("raylane")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"
