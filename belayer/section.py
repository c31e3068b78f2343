"""Base class of every configuration section."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid")
