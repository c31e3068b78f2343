"""Test helpers for users' own tests: a scripted rollout engine.

`ScriptedRollout` serves the same `generate` activity contract as a real rollout node
(context by reference in, context by reference out, heartbeated tokens), without vLLM:
token ids are drawn from (seed, absolute position), so runs are reproducible and a
retried turn produces the same tokens, like the real node's sampler. For model tasks a
script of replies (text per turn) stands in for the model.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from pathlib import Path

from temporalio import activity
from tokenizers import Tokenizer

from belayer.activities.context import ContextActivities
from belayer.activities.runtime import implements
from belayer.contracts.generate import GENERATE, EngineTiming, GenerateArgs, GenerateResult
from belayer.storage.generation import SampledTokens, write_generation
from belayer.storage.tokenlog import TokenLog


class ScriptedRollout:
    """A stand-in rollout node: deterministic tokens, optional scripted replies."""

    def __init__(
        self,
        store,
        tokenizer_path: Path,
        *,
        replies: list[str] | None = None,
        per_token_s: float = 0.0,
        node_queue: str = "scripted-rollout",
    ):
        self.store = store
        self.tokenizer_path = tokenizer_path
        self.replies = list(replies or [])
        self.per_token_s = per_token_s
        self.node_queue = node_queue
        self.calls = 0

    @functools.cached_property
    def tokenizer(self):
        return Tokenizer.from_file(str(self.tokenizer_path))

    @functools.cached_property
    def context(self):
        return ContextActivities(self.store, self.tokenizer_path)

    @implements(GENERATE)
    async def generate(self, args: GenerateArgs) -> GenerateResult:
        started = time.monotonic()
        prefix = args.prefix
        if args.observation is not None:  # appended first, as the real node does
            prefix = (
                await asyncio.to_thread(lambda: self.context.start_append(args.observation).wait())
            ).prefix
        log = await asyncio.to_thread(TokenLog.resume, self.store, prefix)
        max_tokens = args.max_tokens_after(prefix)
        turn = self.calls
        self.calls += 1
        if turn < len(self.replies):
            tokens = self.tokenizer.encode(self.replies[turn], add_special_tokens=False).ids
            tokens = tokens[:max_tokens]
        else:
            vocab = self.tokenizer.get_vocab_size()
            tokens = [scripted_token(args.sampling.seed, prefix.length + i, vocab) for i in range(max_tokens)]
        if self.per_token_s:
            await asyncio.sleep(self.per_token_s * len(tokens))
        activity.heartbeat({"tokens": len(tokens)})  # a count, as the real activity's
        head = await asyncio.to_thread(log.append, tokens, source="model")
        generation, versions = None, []
        if tokens:  # logprob 0 (the scripted draw is certain), weights version 0: readable as a rollout
            sampled = SampledTokens(tokens, [0.0] * len(tokens), [0] * len(tokens))
            generation, versions = await asyncio.to_thread(
                write_generation, self.store, log.key, prefix.length, sampled
            )
        total = time.monotonic() - started
        return GenerateResult(
            prefix=head,
            segment_start=prefix.length,
            text=self.tokenizer.decode(tokens, skip_special_tokens=True),
            output_tokens=len(tokens),
            finish_reason="length",
            timing=EngineTiming(prefill_s=0.0, per_token_s=self.per_token_s, queue_s=0.0, total_s=total),
            node_queue=self.node_queue,
            generation=generation,
            weights_versions=versions,
        )


def scripted_token(seed: int, position: int, vocab: int) -> int:
    """The scripted engine's token at `position` of a context sampled with `seed`: reproducible,
    whoever asks (a retried turn, a plain loop that stands beside it)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % vocab
