"""The error every layer raises for bad user input; its own module so that the lowest modules
(pipeline references, paths) can raise it without importing the config tree."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad user input. The message is complete and meant for the user as is."""
