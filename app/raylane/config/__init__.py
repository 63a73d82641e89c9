"""The one typed config tree, validated once at the edge: `sections` (the sections every pipeline
shares), `base` (`BaseConfig`, the tree a pipeline's `Config` extends), `load` (YAML and `--set`
into it, every mistake a one-line `ConfigError`). The sweep file's schema (`sweep`) and the
`autotune:` section's (`autotune`) sit beside them, imported by name. Nothing here imports torch or
Ray, so a bad config is rejected before either starts.

`from raylane.config import X` gives the names below and every shared section (`sections.__all__`,
the one list a new section is added to), wherever they live in the package."""

from raylane.config import sections
from raylane.config.base import BaseConfig, flatten
from raylane.config.load import (
    PIPELINES,
    apply_overrides,
    apply_values,
    check_metric,
    config_class,
    config_path,
    did_you_mean,
    format_validation_error,
    load_config,
    normalize_pipeline,
    parse_override,
    pipeline_config,
    read_config_file,
    read_yaml,
    shipped_configs,
    validate,
)
from raylane.config.sections import *  # noqa: F403 - the shared sections, as sections.__all__ lists them
from raylane.config.shapes import for_shapes, shapes_only
from raylane.errors import ConfigError

__all__ = [
    "PIPELINES",
    "BaseConfig",
    "ConfigError",
    "apply_overrides",
    "apply_values",
    "check_metric",
    "config_class",
    "config_path",
    "did_you_mean",
    "flatten",
    "for_shapes",
    "format_validation_error",
    "load_config",
    "normalize_pipeline",
    "parse_override",
    "pipeline_config",
    "read_config_file",
    "read_yaml",
    "shapes_only",
    "shipped_configs",
    "validate",
]
__all__ += sections.__all__
