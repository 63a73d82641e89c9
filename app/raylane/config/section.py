"""The base of every config section: unknown keys, NaN and infinity refused. Its own module so that
raylane.config.sections and raylane.config.strategy both build on it without importing each other."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys, NaN and infinity refused; an assignment is validated too."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)
