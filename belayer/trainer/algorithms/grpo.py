"""GRPO: each reward against its group's mean in units of the group's spread, and the
PPO clipped surrogate, as a token-level mean over the minibatch's model tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

from belayer.trainer.algorithms.base import Algorithm, TokenTerms

if TYPE_CHECKING:
    from torch import Tensor

    from belayer.trainer.models import TrainerSettings

ADVANTAGE_EPS = 1e-6


def advantages(rewards: list[float]) -> list[float]:
    """Zero for every member when all scored the same: such a group teaches nothing."""
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [(r - mean) / (std + ADVANTAGE_EPS) for r in rewards]


def clipped_surrogate(terms: TokenTerms, settings: TrainerSettings, tokens: int) -> tuple[Tensor, int]:
    """`-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)` summed over the sample's model
    tokens, divided by the minibatch's; the ratio is against the sampling policy."""
    ratio = (terms.logp - terms.old).exp()
    clipped_ratio = ratio.clamp(1 - settings.clip_eps, 1 + settings.clip_eps)
    surrogate = (ratio * terms.advantage).minimum(clipped_ratio * terms.advantage)
    loss = -(surrogate * terms.mask).sum() / tokens
    return loss, clipped_tokens(ratio, terms, settings.clip_eps)


def clipped_tokens(ratio: Tensor, terms: TokenTerms, eps: float) -> int:
    """Model tokens where the clip decided the loss, as TRL counts them (`clip_ratio`): a
    ratio below 1 - eps with a negative advantage, or above 1 + eps with a positive one.
    Outside the band on the other side the unclipped term is the smaller, so no clip acts."""
    low = (ratio < 1 - eps) & (terms.advantage < 0)
    high = (ratio > 1 + eps) & (terms.advantage > 0)
    return int(((low | high).float() * terms.mask).sum().item())


ALGORITHM = Algorithm("grpo", advantages, clipped_surrogate)
