"""The `generate` activity's contract: one turn of generation on a rollout node, the
context in and out by reference (belayer/activities/generate.py says how)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from belayer.contracts.activity import Activity
from belayer.contracts.context import AppendObservationArgs
from belayer.storage.generation import GenerationRef
from belayer.storage.tokenlog import PrefixRef


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Model):
    """Sampling of one turn. With temperature > 0 every position draws from (seed, position)."""

    max_tokens: int = Field(ge=1, le=32768, description="Tokens to generate at most in this turn.")
    temperature: float = Field(0.0, ge=0, le=5, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 keeps all.")
    seed: int = Field(0, ge=0, lt=2**63, description="With the absolute position, fixes every draw.")
    stop: list[str] = Field(default_factory=list, description="Stop when the text contains one of these.")
    ignore_eos: bool = Field(False, description="Generate exactly max_tokens (trace replays).")


class GenerateArgs(_Model):
    prefix: PrefixRef = Field(description="The context so far, verified by its sha256 before use.")
    sampling: SamplingParams
    observation: AppendObservationArgs | None = Field(
        None,
        description="The previous action's observation, appended after `prefix` (and its step recorded "
        "in the trajectory's log) before generating: a turn is then one activity here, not two. Its own "
        "`prefix` is this one.",
    )
    max_context: int | None = Field(
        None,
        ge=1,
        description="The context's token budget: the turn generates at most what is left of it "
        "after the observation (nothing when nothing is left).",
    )

    def max_tokens_after(self, prefix: PrefixRef) -> int:
        """Tokens this turn may generate after `prefix` (its context, observation appended)."""
        if self.max_context is None:
            return self.sampling.max_tokens
        return max(0, min(self.sampling.max_tokens, self.max_context - prefix.length))

    @model_validator(mode="after")
    def _observation_follows_prefix(self) -> GenerateArgs:
        if self.observation is not None and self.observation.prefix != self.prefix:
            raise ValueError("the observation must be appended after this turn's prefix")
        return self


class EngineTiming(_Model):
    """What the engine measured; the checkpoint policy predicts from it."""

    prefill_s: float = Field(ge=0, description="Request sent → first token (includes queueing on the node).")
    per_token_s: float = Field(ge=0, description="Mean decode latency per token after the first.")
    queue_s: float = Field(ge=0, description="Time not explained by prefill and decode (storage, waiting).")
    total_s: float = Field(ge=0, description="Whole activity attempt.")


class RecoveryReplay(_Model):
    """A turn that an engine recovery interrupted (a takeover or cold start in the node, or a
    retried attempt that went on from the tokens its predecessor stored), checked against
    the same turn generated again on the same engine from its start, uninterrupted.

    The two agree with high probability, not always: the recovered request prefilled what
    the interrupted one had decoded, the kernels sum in another order, and a token whose two
    best choices lie closer than that difference can flip (README, determinism contract).
    The trajectory keeps its own tokens either way (its sandbox ran them); this says
    whether they are the ones an uninterrupted run would most likely have drawn."""

    position: int = Field(ge=0, description="The turn's first token generated after the recovery.")
    tokens_after: int = Field(ge=0, description="The turn's tokens from that position on.")
    outcome: Literal["same", "differs", "not_compared"] = Field(
        description="same / differs: the replay's tokens against the turn's; not_compared: the "
        "replay could not be compared (`detail` says why: weights published meanwhile, a failure)."
    )
    first_difference: int | None = Field(
        None, ge=0, description="differs: the turn's first token where the replay drew another."
    )
    detail: str = Field("", max_length=2000)


class GenerateResult(_Model):
    prefix: PrefixRef = Field(description="The context including this turn's tokens.")
    segment_start: int = Field(0, ge=0, description="Position of this turn's first token in prefix's log.")
    text: str = Field(description="This turn's tokens, decoded (stop string excluded).")
    output_tokens: int = Field(ge=0)
    finish_reason: str = Field(
        description="'length' (max_tokens or context full) or 'stop' (EOS / stop string)."
    )
    timing: EngineTiming
    node_queue: str = Field(description="The node's own queue: send the next turn there (prefix cache).")
    resumed_tokens: int = Field(
        0, ge=0, description="Tokens carried over from a previous attempt's heartbeat."
    )
    observation_tokens: int = Field(
        0, ge=0, description="Tokens the observation appended before this turn's."
    )
    engine_recoveries: list[str] = Field(
        default_factory=list, description="Takeovers / cold starts during this turn."
    )
    generation: GenerationRef | None = Field(
        None,
        description="Where this turn's logprobs and weights versions are stored, one per token "
        "(None when the turn produced no tokens, and in results recorded before they were kept).",
    )
    weights_versions: list[int] = Field(
        default_factory=list,
        description="The weights versions that produced this turn's tokens, in order (one unless "
        "a publish landed during the turn).",
    )
    recovery_replay: RecoveryReplay | None = Field(
        None, description="Set when an engine recovery interrupted this turn: the turn, replayed."
    )


GENERATE = Activity("generate", GenerateArgs, GenerateResult)
