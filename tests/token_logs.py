"""Token logs written with the real writers (model/env marks, the engine's generation
records), in the tiny model's vocabulary: what a trajectory leaves for a trainer."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from belayer.storage.generation import SampledTokens, write_generation
from belayer.storage.tokenlog import PrefixRef, TokenLog

VOCAB = 1900  # below the tiny model's vocabulary (1984)


@dataclass
class Written:
    """What `trajectory` wrote, position by position."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)

    def add(self, tokens: list[int], logprobs=None, versions=None) -> None:
        model = logprobs is not None
        self.tokens += tokens
        self.mask += [int(model)] * len(tokens)
        self.logprobs += logprobs if model else [None] * len(tokens)
        self.versions += versions if model else [None] * len(tokens)


def trajectory(store, key: str, rng: random.Random, version: int, model_turns=(5, 4),
               written: Written | None = None) -> PrefixRef:  # fmt: skip
    """env prompt (6 tokens), then (model turn, env observation) pairs; returns the final
    PrefixRef, and records what it wrote in `written`."""
    written = written if written is not None else Written()
    log = TokenLog.create(store, key)
    prompt = [rng.randrange(VOCAB) for _ in range(6)]
    log.append(prompt, source="env")
    written.add(prompt)
    for turn in model_turns:
        start = log.head.length
        tokens = [rng.randrange(VOCAB) for _ in range(turn)]
        log.append(tokens, source="model")
        if tokens:
            sampled = SampledTokens(tokens, [-rng.uniform(0.5, 8.0) for _ in tokens], [version] * turn)
            write_generation(store, log.key, start, sampled)
            written.add(tokens, list(sampled.logprobs), list(sampled.versions))
        observation = [rng.randrange(VOCAB) for _ in range(3)]
        log.append(observation, source="env")
        written.add(observation)
    return log.head
