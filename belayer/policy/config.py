"""Checkpoint policy settings (DESIGN.md section 5)."""

from typing import Literal

from belayer.section import Section
from pydantic import Field


class PolicyConfig(Section):
    """When to take a full checkpoint of a trajectory's sandbox."""

    mode: Literal["none", "every-step", "adaptive"] = Field(
        "every-step", description="none: never; every-step: after each action; adaptive: in bubbles."
    )
    alpha: float = Field(
        1.0, gt=0, description="Checkpoint when predicted generation time >= alpha x checkpoint cost."
    )
    max_unprotected_steps: int = Field(
        8, ge=1, description="Checkpoint anyway once this many actions are unprotected."
    )
