"""Play a recorded trace through the policy with the workflow's overlap rule.

The workflow starts a chosen checkpoint right after the action, lets it run beside the
next generation, and starts the next action only when both have finished. This module
replays that rule on measured phase durations, so the policy can be tested as a
timeline (bounds, no overlap) and so a benchmark can estimate what the same trace
would cost with the engine on its own accelerator.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from belayer.policy.adaptive import CheckpointPolicy, CheckpointSample, GenerationSample
from belayer.policy.config import PolicyConfig


class TraceStep(BaseModel):
    """Measured durations of one turn."""

    output_tokens: int = Field(ge=0)
    per_token_s: float = Field(ge=0)
    fixed_s: float = Field(0.0, ge=0, description="Per-turn time beside decoding (prefill, queueing).")
    action_s: float = Field(ge=0)
    checkpoint_s: float = Field(ge=0)
    size_mb: float = Field(ge=0)


class Interval(BaseModel):
    kind: str  # "generate" | "action" | "checkpoint"
    step: int
    start: float
    end: float


class Timeline(BaseModel):
    intervals: list[Interval]
    wall_s: float
    checkpoints: int
    max_unprotected_steps: int
    wait_s: float


def simulate(trace: list[TraceStep], config: PolicyConfig, *, end_tokens: int | None = None) -> Timeline:
    """The timeline the workflow would produce for `trace` under `config`.

    Each decision is told the next turn's output tokens, as the workflow tells the policy
    a trace's, unless `config.trace_lengths_known` is off: then, as on a model task, no
    decision is told anything and each predicts from the generations so far. `end_tokens`
    is what the last decision is told about the generation after the last turn: None
    (unknown, as the workflow says today) or 0 (there is none).
    """
    policy = CheckpointPolicy(config=config)
    intervals: list[Interval] = []
    clock = 0.0
    checkpoint_end = 0.0
    waited = 0.0
    max_unprotected = 0
    for step, turn in enumerate(trace):
        generation_s = turn.fixed_s + turn.output_tokens * turn.per_token_s
        intervals.append(Interval(kind="generate", step=step, start=clock, end=clock + generation_s))
        generation_end = clock + generation_s
        policy.observe_generation(
            GenerationSample(output_tokens=turn.output_tokens, per_token_s=turn.per_token_s,
                             queue_s=turn.fixed_s, total_s=generation_s)
        )
        action_start = max(generation_end, checkpoint_end)
        waited += action_start - generation_end
        if policy.decisions and policy.decisions[-1].checkpointed:
            previous = trace[step - 1]
            policy.observe_checkpoint(
                CheckpointSample(duration_s=previous.checkpoint_s, size_mb=previous.size_mb),
                wait_s=action_start - generation_end,
            )
        action_end = action_start + turn.action_s
        intervals.append(Interval(kind="action", step=step, start=action_start, end=action_end))
        policy.observe_action(turn.action_s)
        max_unprotected = max(max_unprotected, policy.unprotected_steps)
        decision = policy.decide(step, turn.size_mb,
                                 expected_output_tokens=_next_tokens_told(trace, step, config, end_tokens))
        if decision.checkpointed:
            checkpoint_end = action_end + turn.checkpoint_s
            intervals.append(
                Interval(kind="checkpoint", step=step, start=action_end, end=checkpoint_end)
            )
        clock = action_end
    wall = max([clock, checkpoint_end if trace else 0.0])
    return Timeline(
        intervals=intervals,
        wall_s=wall,
        checkpoints=sum(1 for i in intervals if i.kind == "checkpoint"),
        max_unprotected_steps=max_unprotected,
        wait_s=waited,
    )


def _next_tokens_told(trace: list[TraceStep], step: int, config: PolicyConfig,
                      end_tokens: int | None) -> int | None:
    """What decision `step` is told about the coming generation's length (None: nothing)."""
    if not config.trace_lengths_known:
        return None
    return trace[step + 1].output_tokens if step + 1 < len(trace) else end_tokens
