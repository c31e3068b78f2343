"""A `TrainSample` read back from the object store: everything the loss needs per token.

Only pointers crossed Temporal; here the trainer reads the tokens (sha256-verified), the
model/environment marks (the loss mask), and, per model token, the weights version that
sampled it and the engine's logprob (the generation records beside the log).
"""

from __future__ import annotations

from dataclasses import dataclass

from belayer.storage.generation import read_generations
from belayer.storage.tokenlog import loss_mask, read_marks, read_prefix
from belayer.trainer.models import TrainSample


@dataclass(frozen=True)
class LoadedSample:
    """One trajectory as arrays of its token positions."""

    sample: TrainSample
    tokens: list[int]
    mask: list[int]  # 1 where the model generated the token
    versions: list[int | None]  # weights version of each model token
    engine_logprobs: list[float | None]  # the engine's logprob of each model token

    def sampled_versions(self) -> set[int]:
        return {v for v in self.versions if v is not None}


def load_sample(store, sample: TrainSample) -> LoadedSample:
    """Read `sample.context` in full; `CorruptObject` when any part is missing or damaged."""
    ref = sample.context
    tokens = read_prefix(store, ref)
    mask = loss_mask(read_marks(store, ref))
    versions, logprobs = read_generations(store, ref)
    return LoadedSample(sample, tokens, mask, versions, logprobs)
