"""What an algorithm is: an advantage estimator and a policy loss under one name.

The two halves run in different processes. The estimator runs inside the training
workflow (Temporal's sandbox, deterministic, replayed): it turns one group's rewards into
one advantage per member, in plain Python. The loss runs in the trainer: it turns one
sample's per-token logprobs into its share of the minibatch loss. So that the workflow
can import an algorithm without torch, an algorithm module never imports torch at run
time: its loss uses only the methods of the tensors it is given (tests/trainer/
test_algorithms.py checks the source).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from belayer.trainer.models import TrainerSettings


@dataclass(frozen=True)
class TokenTerms:
    """One sample as a loss sees it: tensors aligned with its tokens[1:]."""

    logp: Tensor  # the policy being trained (with grad)
    old: Tensor  # the sampling policy, recomputed by the trainer (no grad)
    mask: Tensor  # 1.0 on model tokens, 0.0 elsewhere
    advantage: float  # the estimator's number for this sample, applied to every model token


AdvantageEstimator = Callable[[list[float]], list[float]]
"""One group's rewards, in member order, to one advantage per member."""

PolicyLoss = Callable[["TokenTerms", "TrainerSettings", int], "tuple[Tensor, int]"]
"""(a sample's terms, the run's settings, the minibatch's model tokens) to (the sample's
share of the minibatch loss, how many of its tokens the loss clipped)."""


@dataclass(frozen=True)
class Algorithm:
    name: str
    advantages: AdvantageEstimator
    loss: PolicyLoss
