"""The sampling noise of each position: what makes a sampled token a function of
(seed, absolute position, logits) alone.

A resumed or replayed request draws exactly what an uninterrupted one would, and anyone
holding a trajectory's seed can say how close two tokens came at a position (how the
determinism tests tell a near-tie flip from a real divergence). Torch only: no vLLM.
"""

from __future__ import annotations

import hashlib

import torch


def position_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def gumbel_noise(seed: int, position: int, size: int) -> torch.Tensor:
    """The Gumbel noise added to the logits of every token id at `position` (float64, one
    per id of a `size`-token vocabulary): the sampled token is the argmax of the sum."""
    gen = torch.Generator().manual_seed(position_seed(seed, position))
    uniform = torch.rand(size, generator=gen, dtype=torch.float64).clamp_(1e-300, 1.0)
    return -torch.log(-torch.log(uniform))
