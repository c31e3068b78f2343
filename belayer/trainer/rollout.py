"""`Rollout`: one trajectory ready for a trainer's loss, and `read_rollout`, which reads it
from a `RolloutRef` (a group member by reference) out of the object store.

One data model for every consumer of rollouts. A trainer of yours gets `Rollout`s from the
rollout API (`belayer.RolloutClient`); Belayer's own trainer reads each `TrainSample`'s
`RolloutRef` into the very same `Rollout` and trains on its arrays
(belayer/trainer/samples.py). Only references cross Temporal: the tokens are read here,
sha256-verified (belayer/storage/trajectory_tokens.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from belayer.storage.trajectory_tokens import read_trajectory_tokens
from belayer.trainer.models import RolloutRef


class Rollout(BaseModel):
    """One trajectory, ready for a trainer's loss. `logprobs`, `loss_mask` and
    `weights_versions` are aligned one-to-one with `completion_ids`: the whole multi-turn
    sequence after the prompt, the model's tokens (mask 1: the engine's logprob, the
    weights version that sampled it) and the environment's (mask 0: logprob 0.0, version -1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task_id: str
    member: int = Field(description="Its place in the task's group.")
    status: Literal["completed", "failed_policy", "failed_infra"] = Field(
        description="failed_infra only after Belayer's own retries; such a rollout has no tokens and no reward."
    )
    reward: float | None
    rewards: dict[str, float] = Field(
        description="The verifier's named rewards; today's task kinds have one, `reward`."
    )
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    weights_versions: list[int]
    turns: int = Field(
        description="Actions the agent ran in its sandbox (a last model turn without one is not counted)."
    )
    recoveries: int = Field(description="Sandbox recoveries Belayer made on its way (over all attempts).")
    tokens_after_recovery: int = Field(
        0,
        description="Tokens generated after an engine recovery interrupted a turn: equal to an "
        "uninterrupted run's with high probability, not surely (a near-tie can flip).",
    )
    recovered_tokens_differ: bool = Field(
        False, description="Flag: a recovered turn, replayed uninterrupted on its engine, drew other tokens."
    )
    attempts: int = Field(description="Trajectories run for this member (more than 1: failed_infra retried).")
    trajectory_id: str = Field(description="Open it in the Temporal web UI or with `belayer inspect`.")
    reason: str = ""

    @model_validator(mode="after")
    def _aligned(self) -> Rollout:
        lengths = {
            len(self.completion_ids),
            len(self.logprobs),
            len(self.loss_mask),
            len(self.weights_versions),
        }
        if len(lengths) != 1:
            raise ValueError(
                f"rollout {self.trajectory_id}: per-token lists of different lengths {sorted(lengths)}"
            )
        return self


def read_rollout(store, outcome: RolloutRef) -> Rollout:
    """`outcome` with its tokens read from the object store (none for failed_infra)."""
    prompt, completion, logprobs, mask, versions = [], [], [], [], []
    if outcome.context is not None:
        read = read_trajectory_tokens(store, outcome.context)
        cut = read.prompt_length
        prompt, completion, mask = read.tokens[:cut], read.tokens[cut:], read.mask[cut:]
        logprobs = [0.0 if lp is None else lp for lp in read.logprobs[cut:]]
        versions = [-1 if v is None else v for v in read.versions[cut:]]
    return Rollout(
        task_id=outcome.task,
        member=outcome.member,
        status=outcome.status,
        reward=outcome.reward,
        rewards={} if outcome.reward is None else {"reward": outcome.reward},
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=logprobs,
        loss_mask=mask,
        weights_versions=versions,
        turns=outcome.turns,
        recoveries=outcome.recoveries,
        tokens_after_recovery=outcome.tokens_after_recovery,
        recovered_tokens_differ=outcome.recovered_tokens_differ,
        attempts=outcome.attempts,
        trajectory_id=outcome.trajectory_id,
        reason=outcome.reason,
    )
