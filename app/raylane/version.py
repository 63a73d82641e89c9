"""raylane's version, as installed: on the ground floor, so that the loop and the tracking code
read it without importing the package door (`raylane/__init__.py` imports the API, which imports
the preparation path)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("raylane")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"
