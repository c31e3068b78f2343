"""RLOO's baseline under GRPO's loss: each reward against the mean of the *other*
members of its group (REINFORCE Leave-One-Out, Ahmadian et al. 2024), not scaled by the
group's spread, so a group with a wider spread of rewards pushes harder."""

from __future__ import annotations

from belayer.trainer.algorithms import grpo
from belayer.trainer.algorithms.base import Algorithm


def advantages(rewards: list[float]) -> list[float]:
    """`r_i - mean(r_j, j != i)`; a group has at least two members (TrainingInput.group_size)."""
    total, others = sum(rewards), len(rewards) - 1
    return [r - (total - r) / others for r in rewards]


ALGORITHM = Algorithm("rloo", advantages, grpo.clipped_surrogate)
