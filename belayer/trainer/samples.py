"""A `TrainSample` read back from the object store as the `Rollout` the rollout API hands
a trainer of yours (belayer/trainer/rollout.py), and laid out per token position for the
loss: one data model for Belayer's trainer and every other."""

from __future__ import annotations

from dataclasses import dataclass

from belayer.storage.errors import CorruptObject
from belayer.trainer.models import RolloutRef, SkippedGroup, TrainSample
from belayer.trainer.rollout import Rollout, read_rollout


@dataclass(frozen=True)
class LoadedSample:
    """One trajectory as arrays over all its token positions (prompt and completion)."""

    sample: TrainSample
    rollout: Rollout
    tokens: list[int]
    mask: list[int]  # 1 where the model generated the token
    versions: list[int | None]  # weights version of each model token
    engine_logprobs: list[float | None]  # the engine's logprob of each model token

    @classmethod
    def of(cls, sample: TrainSample, rollout: Rollout) -> LoadedSample:
        """`rollout`'s arrays over every position: the prompt's are environment positions
        (mask 0, no version, no logprob), like the completion's observation tokens."""
        prompt = [None] * len(rollout.prompt_ids)
        model = [m == 1 for m in rollout.loss_mask]
        return cls(
            sample=sample,
            rollout=rollout,
            tokens=[*rollout.prompt_ids, *rollout.completion_ids],
            mask=[0] * len(prompt) + rollout.loss_mask,
            versions=prompt
            + [v if m else None for v, m in zip(rollout.weights_versions, model, strict=True)],
            engine_logprobs=prompt
            + [lp if m else None for lp, m in zip(rollout.logprobs, model, strict=True)],
        )

    def sampled_versions(self) -> set[int]:
        return {v for v in self.versions if v is not None}


def load_sample(store, sample: TrainSample) -> LoadedSample:
    """Read `sample`'s rollout in full; `CorruptObject` when any part is missing or damaged."""
    ref = sample.rollout or RolloutRef(trajectory_id=sample.trajectory_id, status="completed", reward=None,
                                       attempts=1, context=sample.context)  # a sample from before `rollout`  # fmt: skip
    return LoadedSample.of(sample, read_rollout(store, ref))


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
