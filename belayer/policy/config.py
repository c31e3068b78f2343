"""Checkpoint policy settings (docs/design.md §5)."""

from typing import Literal

from pydantic import Field

from belayer.section import Section


class PolicyConfig(Section):
    """When to take a full checkpoint of a trajectory's sandbox."""

    mode: Literal["none", "every-step", "adaptive"] = Field(
        "adaptive", description="none: never; every-step: after each action; adaptive: in bubbles."
    )
    # 2, not 1: a checkpoint that outlasts its generation stalls the next action, while a
    # skipped one only leaves work unprotected (bounded below). Measured predictor errors
    # were 30-60% (generation) and ~35% (checkpoint), so the margin is needed; see
    # `belayer bench overhead`.
    alpha: float = Field(
        2.0,
        gt=0,
        le=100,
        description="Checkpoint when predicted generation time >= alpha x checkpoint cost.",
    )
    max_unprotected_steps: int = Field(
        8, ge=1, le=10_000, description="Checkpoint anyway once this many actions are unprotected."
    )
    max_unprotected_replay_s: float = Field(
        30.0,
        gt=0,
        description="Checkpoint anyway once replaying the unprotected actions would take this long.",
    )
    history: int = Field(
        5, ge=1, le=100, description="How many recent turns and checkpoints the predictors average."
    )
    prior_checkpoint_s: float = Field(
        1.0, gt=0, description="Checkpoint cost assumed before any checkpoint was measured (s)."
    )
    prior_token_latency_s: float = Field(
        0.01, gt=0, description="Per-token decode latency assumed before the engine reports one (s)."
    )
    # A trace says how long each generation will be; a model task cannot. Turned off, the
    # policy predicts a trace's generations from history too: `belayer bench overhead`
    # measures the model-task view over the trace's reproducible generations that way.
    trace_lengths_known: bool = Field(
        True,
        description="On a trace task, tell the policy each coming generation's length "
        "(false: it predicts from recent generations, as on a model task).",
    )
