"""Play a recorded trace through the policy with the workflow's overlap rule.

The workflow starts a chosen checkpoint right after the action and lets it run beside the
next generation. A staged checkpoint (`TraceStep.capture_s` given) comes in two halves: the
next action waits for its capture only, and its publish runs beside that action; a decision
made while the publish still runs skips (adaptive) or waits for it (every-step, or adaptive
at its bound of unprotected work). A checkpoint in one call (`capture_s` None, as before
staging) is waited for whole by the next action. This module replays that rule on measured
phase durations, so the policy can be tested as a timeline (bounds, no capture beside an
action) and so a benchmark can estimate what the same trace would cost with the engine on
its own accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field

from belayer.policy.adaptive import CheckpointPolicy, CheckpointSample, GenerationSample
from belayer.policy.config import PolicyConfig


class TraceStep(BaseModel):
    """Measured durations of one turn."""

    output_tokens: int = Field(ge=0)
    per_token_s: float = Field(ge=0)
    fixed_s: float = Field(0.0, ge=0, description="Per-turn time beside decoding (prefill, queueing).")
    action_s: float = Field(ge=0)
    checkpoint_s: float = Field(ge=0, description="The whole checkpoint after this turn's action.")
    capture_s: float | None = Field(
        None,
        ge=0,
        description="Of it, the capture the next action waits for (a staged checkpoint); "
        "None: the next action waits for the whole checkpoint.",
    )
    size_mb: float = Field(ge=0)


class Interval(BaseModel):
    kind: (
        str  # "generate" | "action" | "checkpoint" (the capture, or a whole one-call checkpoint) | "publish"
    )
    step: int
    start: float
    end: float


class Timeline(BaseModel):
    intervals: list[Interval]
    wall_s: float
    checkpoints: int
    max_unprotected_steps: int
    wait_s: float


@dataclass
class _InFlight:
    """A checkpoint the simulated workflow has started and not yet accounted for."""

    step: int
    decision: int
    captured_at: float
    publish_s: float
    sample: CheckpointSample
    waited_s: float = 0.0
    published_at: float | None = None  # known once the next action starts it


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
    clock, waited, max_unprotected = 0.0, 0.0, 0
    flight: _InFlight | None = None

    def settle(at: float) -> float:
        """Account for the checkpoint in flight once it is stored, not before `at`; the time
        that is then."""
        nonlocal flight, waited
        done = max(at, flight.published_at)
        waited += done - at
        policy.observe_checkpoint(flight.sample, wait_s=flight.waited_s + done - at, decision=flight.decision)
        flight = None
        return done

    for step, turn in enumerate(trace):
        generation_s = turn.fixed_s + turn.output_tokens * turn.per_token_s
        generation_end = clock + generation_s
        intervals.append(Interval(kind="generate", step=step, start=clock, end=generation_end))
        policy.observe_generation(
            GenerationSample(
                output_tokens=turn.output_tokens,
                per_token_s=turn.per_token_s,
                queue_s=turn.fixed_s,
                total_s=generation_s,
            )
        )
        action_start = generation_end
        if flight is not None and flight.published_at is None:  # its publish starts with this action
            action_start = max(generation_end, flight.captured_at)
            flight.waited_s = action_start - generation_end
            waited += flight.waited_s
            flight.published_at = action_start + flight.publish_s
            if flight.publish_s:
                intervals.append(
                    Interval(kind="publish", step=flight.step, start=action_start, end=flight.published_at)
                )
        action_end = action_start + turn.action_s
        intervals.append(Interval(kind="action", step=step, start=action_start, end=action_end))
        policy.observe_action(turn.action_s)
        max_unprotected = max(max_unprotected, policy.unprotected_steps)
        storing = None
        if flight is not None:
            if flight.published_at > action_end and policy.skips_past_storing():
                storing = flight.step
            else:
                action_end = settle(action_end)
        told = _next_tokens_told(trace, step, config, end_tokens)
        decision = policy.decide(step, turn.size_mb, expected_output_tokens=told, storing_step=storing)
        if decision.checkpointed:
            capture_s = (
                turn.checkpoint_s if turn.capture_s is None else min(turn.capture_s, turn.checkpoint_s)
            )
            flight = _InFlight(
                step=step,
                decision=policy.decided,
                captured_at=action_end + capture_s,
                publish_s=turn.checkpoint_s - capture_s,
                sample=CheckpointSample(
                    duration_s=turn.checkpoint_s, size_mb=turn.size_mb, capture_s=turn.capture_s
                ),
            )
            intervals.append(Interval(kind="checkpoint", step=step, start=action_end, end=flight.captured_at))
        clock = action_end
    if flight is not None:  # the end waits for the last checkpoint, captured and stored
        if flight.published_at is None:  # no action started its publish: the end does
            flight.published_at = max(clock, flight.captured_at) + flight.publish_s
            if flight.publish_s:
                intervals.append(
                    Interval(
                        kind="publish",
                        step=flight.step,
                        start=flight.published_at - flight.publish_s,
                        end=flight.published_at,
                    )
                )
        clock = max(clock, flight.published_at)
    return Timeline(
        intervals=intervals,
        wall_s=clock,
        checkpoints=sum(1 for i in intervals if i.kind == "checkpoint"),
        max_unprotected_steps=max_unprotected,
        wait_s=waited,
    )


def _next_tokens_told(
    trace: list[TraceStep], step: int, config: PolicyConfig, end_tokens: int | None
) -> int | None:
    """What decision `step` is told about the coming generation's length (None: nothing)."""
    if not config.trace_lengths_known:
        return None
    return trace[step + 1].output_tokens if step + 1 < len(trace) else end_tokens
