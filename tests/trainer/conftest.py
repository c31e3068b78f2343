"""Synthetic GRPO batches written with the real writers: token logs with model/env marks
and the engine's generation records, in the tiny model's vocabulary."""

from __future__ import annotations

import random
import statistics

import pytest

from belayer.storage.generation import SampledTokens, write_generation
from belayer.storage.store import open_store
from belayer.storage.tokenlog import TokenLog
from belayer.trainer.models import TrainerSettings, TrainSample, TrainStepArgs

VOCAB = 1900  # below the tiny model's vocabulary (1984)


@pytest.fixture
def store(storage_config):
    with open_store(storage_config, encrypted=False) as store:
        yield store


def trajectory(store, key: str, rng: random.Random, version: int, model_turns=(5, 4)):
    """env prompt, then (model turn, env observation) pairs; returns the final PrefixRef."""
    log = TokenLog.create(store, key)
    log.append([rng.randrange(VOCAB) for _ in range(6)], source="env")
    for turn in model_turns:
        start = log.head.length
        tokens = [rng.randrange(VOCAB) for _ in range(turn)]
        log.append(tokens, source="model")
        if tokens:
            write_generation(
                store,
                log.key,
                start,
                SampledTokens(tokens, [-rng.uniform(0.5, 8.0) for _ in tokens], [version] * turn),
            )
        log.append([rng.randrange(VOCAB) for _ in range(3)], source="env")
    return log.head


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


def step_args(run_id: str, samples, *, iteration=0, base=None, **settings) -> TrainStepArgs:
    settings = {"lr": 1e-3, **settings}
    return TrainStepArgs(
        run_id=run_id,
        iteration=iteration,
        model="tiny",
        base=base,
        samples=samples,
        settings=TrainerSettings(**settings),
        sampled_version=base.weights_version if base else 1,
    )
