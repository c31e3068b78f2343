"""A `TrainSample` read back from the object store: everything the loss needs per token
(belayer/storage/trajectory_tokens.py reads it, as it does for the rollout API)."""

from __future__ import annotations

from dataclasses import dataclass

from belayer.storage.errors import CorruptObject
from belayer.storage.trajectory_tokens import read_trajectory_tokens
from belayer.trainer.models import SkippedGroup, TrainSample


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
    read = read_trajectory_tokens(store, sample.context)
    return LoadedSample(sample, read.tokens, read.mask, read.versions, read.logprobs)


def load_groups(store, samples: list[TrainSample]) -> tuple[list[LoadedSample], list[SkippedGroup]]:
    """Every sample of the groups whose members all read back intact, in the order given,
    and the groups left out whole, with why: a member whose token log is missing or damaged
    costs its group (advantages are relative within it), not the run."""
    loaded: list[LoadedSample] = []
    broken: dict[str, str] = {}
    for sample in samples:
        if sample.group in broken:
            continue
        try:
            loaded.append(load_sample(store, sample))
        except CorruptObject as exc:
            broken[sample.group] = f"member {sample.trajectory_id}'s token log does not verify: {exc}"
    kept = [s for s in loaded if s.sample.group not in broken]
    return kept, [SkippedGroup(group=group, reason=reason) for group, reason in broken.items()]
