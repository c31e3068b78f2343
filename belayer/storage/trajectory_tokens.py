"""A trajectory's token log read back in full, as per-position arrays: what a trainer
trains on and what a `Rollout` hands to another trainer (one reader for both).

Only pointers cross Temporal; here the tokens are read (sha256-verified), with the
model/environment marks (the loss mask) and, per model token, the weights version that
sampled it and the engine's logprob (the generation records beside the log).
"""

from __future__ import annotations

from dataclasses import dataclass

from belayer.storage.generation import read_generations
from belayer.storage.tokenlog import PrefixRef, loss_mask, read_marks, read_prefix


@dataclass(frozen=True)
class TrajectoryTokens:
    """One trajectory as arrays of its token positions, all of the same length."""

    tokens: list[int]
    mask: list[int]  # 1 where the model generated the token
    versions: list[int | None]  # weights version of each model token, None elsewhere
    logprobs: list[float | None]  # the engine's logprob of each model token, None elsewhere

    @property
    def prompt_length(self) -> int:
        """Tokens before the model's first one: the instruction the trajectory started from
        (the whole log when the model never generated)."""
        return next((i for i, m in enumerate(self.mask) if m), len(self.mask))


def read_trajectory_tokens(store, ref: PrefixRef) -> TrajectoryTokens:
    """Read `ref` in full; `CorruptObject` when any part is missing or damaged."""
    tokens = read_prefix(store, ref)
    mask = loss_mask(read_marks(store, ref))
    versions, logprobs = read_generations(store, ref)
    return TrajectoryTokens(tokens, mask, versions, logprobs)


def where_they_part(ours: TrajectoryTokens, theirs: TrajectoryTokens) -> str:
    """Where two runs of one trajectory first differ, said so that the cause reads off it:
    in a token the model generated (two logprobs a hair apart are a near-tie that flipped;
    far apart, the contexts differed) or in an observation (the environment answered
    differently: the agent's own race, or a sandbox that disagreed with its context)."""
    at = next((i for i, (a, b) in enumerate(zip(ours.tokens, theirs.tokens, strict=False)) if a != b), None)
    if at is None:
        if len(ours.tokens) == len(theirs.tokens):
            return "no token differs"
        at = min(len(ours.tokens), len(theirs.tokens))
        return f"one ends at position {at}, the other goes on ({len(ours.tokens)} and {len(theirs.tokens)} tokens)"
    where = f"tokens part at position {at} of {len(ours.tokens)} and {len(theirs.tokens)}"
    if ours.mask[at] and theirs.mask[at]:
        return (
            f"{where}, in a generated token: {ours.tokens[at]} (logprob {ours.logprobs[at]}, "
            f"v{ours.versions[at]}) against {theirs.tokens[at]} (logprob {theirs.logprobs[at]}, v{theirs.versions[at]})"
        )
    if not ours.mask[at] and not theirs.mask[at]:
        return f"{where}, in an observation: the environment answered differently"
    return f"{where}, where one generated and the other observed"
