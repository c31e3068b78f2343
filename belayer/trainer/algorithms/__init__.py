"""The algorithms a run can train with, by name (`TrainerSettings.algorithm`).

Each is one module of this package defining `ALGORITHM` (belayer/trainer/algorithms/
base.py says what its two halves are) and listed in `_MODULES`. Torch-free: the training
workflow imports this package (through belayer/contracts/trainer.py) for the advantages.
"""

from __future__ import annotations

from belayer.errors import BelayerError
from belayer.trainer.algorithms import grpo, rloo
from belayer.trainer.algorithms.base import Algorithm, PolicyLoss, TokenTerms

__all__ = ["ALGORITHMS", "DEFAULT", "Algorithm", "PolicyLoss", "TokenTerms", "UnknownAlgorithm", "algorithm"]

_MODULES = (grpo, rloo)
ALGORITHMS: dict[str, Algorithm] = {m.ALGORITHM.name: m.ALGORITHM for m in _MODULES}
DEFAULT = grpo.ALGORITHM.name


class UnknownAlgorithm(BelayerError, ValueError):
    """A configuration names an algorithm no module registers."""


def algorithm(name: str) -> Algorithm:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise UnknownAlgorithm(
            f"unknown algorithm {name!r}; known: {', '.join(sorted(ALGORITHMS))}"
        ) from None
