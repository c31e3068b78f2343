"""Synthetic GRPO batches written with the real writers: token logs with model/env marks
and the engine's generation records, in the tiny model's vocabulary."""

from __future__ import annotations

import random
import statistics

import pytest

from belayer.storage.store import open_store
from belayer.trainer.models import TrainerSettings, TrainSample, TrainStepArgs
from tests.token_logs import trajectory


@pytest.fixture
def store(storage_config):
    with open_store(storage_config, encrypted=False) as store:
        yield store


def group(
    store, name: str, rewards: list[float], *, version: int = 1, seed: int = 0, model_turns=(5, 4)
) -> list[TrainSample]:
    """One GRPO group: a trajectory per reward, advantages normalised within the group."""
    rng = random.Random(f"{name}:{seed}")
    mean, spread = statistics.fmean(rewards), statistics.pstdev(rewards) or 1.0
    return [
        TrainSample(
            trajectory_id=f"{name}-{i}",
            group=name,
            context=trajectory(store, f"traj/{name}/{i}", rng, version, model_turns),
            advantage=(reward - mean) / spread,
        )
        for i, reward in enumerate(rewards)
    ]


def batch(store, *, version: int = 1) -> list[TrainSample]:
    return group(store, "g0", [1.0, 0.0, 0.5], version=version) + group(
        store, "g1", [0.0, 1.0], version=version
    )


def step_args(run_id: str, samples, *, iteration=0, base=None, model="tiny", **settings) -> TrainStepArgs:
    settings = {"lr": 1e-3, "minibatches": 1, **settings}
    return TrainStepArgs(
        run_id=run_id,
        iteration=iteration,
        model=model,
        base=base,
        samples=samples,
        settings=TrainerSettings(**settings),
        sampled_version=base.weights_version if base else 1,
    )
