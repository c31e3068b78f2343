"""The `generate` activity: one turn of generation on a rollout node.

Input is a reference to the context (token log key, length, sha256) and sampling
parameters; output is the reference of the context with the generated tokens appended
(the new segment is `[segment_start, prefix.length)`, marked "model" in the log), the
decoded text, the finish reason, the engine's timing, and a `GenerationRef` to the turn's
logprobs and weights versions, stored beside the token log (`belayer.storage.generation`).
Token ids never cross Temporal, heartbeats included: the tokens produced so far, with
their logprobs and versions, are written to the object store beside the token log, and
the heartbeat carries their count, key and hash (`PartialTokens`), which lets a retry on
another node resume mid-turn instead of starting over: with temperature > 0 each
position draws from (seed, absolute position), so the resumed attempt produces exactly
the tokens the failed one would have, and the turn's record covers all of its tokens.

Served by a rollout node worker (`python -m belayer.workers.rollout`) on the node's own
task queue and on the shared rollout queue. Its arguments and result are the contract
`belayer.contracts.generate.GENERATE`, which is what workflows import.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field
from temporalio import activity
from temporalio.exceptions import ApplicationError
from tokenizers import Tokenizer

from belayer.activities.context import ContextActivities, PreparedAppend, StartedAppend
from belayer.activities.runtime import FailsAs, Failures, heartbeating, implements
from belayer.contracts.errors import BAD_REQUEST, CORRUPT_PREFIX, NODE_FULL
from belayer.contracts.generate import (
    GENERATE,
    EngineTiming,
    GenerateArgs,
    GenerateResult,
    RecoveryReplay,
    SamplingParams,
)
from belayer.rollout.errors import BadRequestError, NodeFull, RolloutError
from belayer.rollout.protocol import SamplingSpec
from belayer.storage.errors import CorruptObject, StorageError
from belayer.storage.generation import SampledTokens, decode_sampled, encode_sampled, write_generation
from belayer.storage.tokenlog import (
    PrefixRef,
    TokenLog,
    encode_tokens,
    prefix_sha256,
    read_prefix,
    remember_tokens,
)

if TYPE_CHECKING:
    from belayer.rollout.node import RequestHandle

MAX_HEARTBEAT_EVERY_S = 1.0
# Bad input is final (another node would refuse it too); the rest follows its `retryable`.
FAILURES = Failures(
    {
        BadRequestError: FailsAs(BAD_REQUEST),
        CorruptObject: FailsAs(CORRUPT_PREFIX, "context reference does not verify"),
    }
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PartialTokens(_Model):
    """What a generate heartbeat carries: where the tokens so far are stored, not the tokens."""

    tokens: int = Field(ge=0, description="How many tokens the stored object holds.")
    key: str | None = Field(
        None,
        description="Object key of the tokens so far, with their logprobs and versions "
        "(`belayer.storage.generation.encode_sampled`; None: nothing stored yet).",
    )
    sha256: str | None = Field(None, description="sha256 of that object, checked on resume.")


class RolloutActivities:
    """`generate` bound to one rollout node and one object store."""

    def __init__(self, node, store, node_queue: str):
        self.node = node
        self.store = store
        self.node_queue = node_queue

    @functools.cached_property
    def tokenizer(self):

        return Tokenizer.from_file(str(self.node.model_dir / "tokenizer.json"))

    @functools.cached_property
    def context(self):
        """The context activities' append, run here for a turn that brings its observation."""

        return ContextActivities(self.store, self.node.model_dir / "tokenizer.json")

    @implements(GENERATE, FAILURES)
    async def generate(self, args: GenerateArgs) -> GenerateResult:

        started = time.monotonic()
        try:
            turn = await asyncio.to_thread(self._begin_turn, args)
        except NodeFull as full:
            raise self._refused(full) from None
        prefix, context, resumed, observation = turn.prefix, turn.context, turn.resumed, turn.observation
        # A cut context is forked by the workflow's next append (`fork_to`), never here.
        log = TokenLog(self.store, prefix.key, prefix=encode_tokens(context))
        produced = resumed
        stored = bool(resumed) or activity.info().attempt > 1  # an earlier attempt may have stored some
        finish_reason, prefill_s, per_token_s, recoveries, replay = "length", 0.0, 0.0, [], None
        if turn.request is not None:
            try:
                completion, last_beat = await self._await_with_heartbeats(
                    turn.request, resumed, _partial_key(prefix)
                )
            except asyncio.CancelledError:
                self.node.cancel(turn.request.request_id, "activity cancelled")
                raise
            produced += _sampled(completion)
            stored = stored or last_beat.key is not None
            finish_reason, prefill_s = completion.finish_reason, completion.prefill_s
            per_token_s, recoveries = completion.decode_s_per_token, list(completion.recoveries)
            recovered_at = first_recovery(len(resumed), completion.recovered_at)
            if recovered_at is not None and recovered_at < len(produced):
                replay = await self._replay_turn(turn, args, produced, recovered_at, last_beat)
        head, generation, versions = await asyncio.to_thread(
            self._store_turn,
            log,
            context,
            prefix.length,
            produced,
            _partial_key(prefix) if stored else None,
            observation,
        )
        text = self.tokenizer.decode(produced.tokens, skip_special_tokens=True)
        for stop in args.sampling.stop:
            if stop in text:
                text = text[: text.index(stop)]
        total = time.monotonic() - started
        return GenerateResult(
            prefix=head,
            segment_start=prefix.length,
            text=text,
            output_tokens=len(produced),
            finish_reason=finish_reason,
            timing=EngineTiming(
                prefill_s=prefill_s,
                per_token_s=per_token_s,
                queue_s=max(0.0, total - prefill_s - per_token_s * len(produced)),
                total_s=total,
            ),
            node_queue=self.node_queue,
            resumed_tokens=len(resumed),
            observation_tokens=len(observation.tokens) if observation is not None else 0,
            engine_recoveries=recoveries,
            generation=generation,
            weights_versions=versions,
            recovery_replay=replay,
        )

    def _refused(self, full: NodeFull) -> ApplicationError:
        """A node at its capacity refuses a turn at once. Asked on its own queue (the turn's
        affinity) the refusal is final, so the trajectory sends the turn to the shared queue
        instead of waiting out its affinity timeout there; asked on the shared queue, the
        activity is retried with backoff by whichever node polls with room (a full node
        does not poll it: belayer/workers/rollout/slots.py)."""
        return ApplicationError(
            str(full), type=NODE_FULL, non_retryable=activity.info().task_queue == self.node_queue
        )

    def _store_turn(
        self,
        log,
        context: list[int],
        start: int,
        produced: SampledTokens,
        partial_key: str | None,
        observation: StartedAppend | None,
    ):
        """The observation's writes finished (they ran beside the generation and come
        first), the turn's segment, then its logprobs and versions (an object at this
        position then always describes these tokens), then the partial tokens dropped: one
        thread hop for all, as the turn's result waits on them."""

        if observation is not None:
            observation.wait()
        head = log.append(produced.tokens, source="model")
        remember_tokens(self.store, head, context + produced.tokens)  # the next turn reads only what follows
        generation, versions = None, []
        if produced:
            generation, versions = write_generation(self.store, log.key, start, produced)
        if partial_key is not None:
            self.store.delete(partial_key)
        return head, generation, versions

    def _begin_turn(self, args: GenerateArgs) -> BegunTurn:
        """Everything before the engine works, in one thread hop: the context (verified), the
        observation's append prepared, tokens an earlier attempt stored, the request
        submitted, and only then the observation's writes started, so that they run beside
        the generation instead of ahead of it (~4 ms of each turn here). Submitting takes
        the node's lock, which a takeover or cold start holds for seconds: hence a thread."""
        prefix, context, prepared = self._context_of(args)
        max_tokens = args.max_tokens_after(prefix)
        partial = _heartbeated_partial()
        resumed = (self._resumed(partial) if partial else SampledTokens()).first(max_tokens)
        spec = _sampling_spec(args.sampling, max_tokens - len(resumed))
        request = (
            self.node.submit(context + resumed.tokens, spec, _attempt_id()) if spec.max_tokens > 0 else None
        )
        try:
            observation = prepared.start() if prepared is not None else None
        except BaseException:
            if request is not None:
                self.node.cancel(request.request_id, "the observation's writes did not start")
            raise
        return BegunTurn(prefix, context, resumed, request, observation)

    def _context_of(self, args: GenerateArgs) -> tuple[PrefixRef, list[int], PreparedAppend | None]:
        """The prefix this turn generates after and its tokens (verified by its sha256), and
        the observation's append, prepared, when the turn brings one."""

        context = read_prefix(self.store, args.prefix)
        if args.observation is None:
            return args.prefix, context, None
        prepared = self.context.prepare_append(args.observation)
        context += prepared.tokens
        prefix = prepared.result.prefix
        if prefix_sha256(context) != prefix.sha256:
            raise CorruptObject(f"token log {prefix.key!r} does not hold the context plus the observation")
        return prefix, context, prepared

    async def _await_with_heartbeats(self, handle, resumed: SampledTokens, partial_key: str):
        """Heartbeat until the request is done, storing the tokens so far (with their
        logprobs and versions) as they grow; returns the completion and what was last
        stored (and heartbeated).

        Reading them takes the node's lock, which a takeover or cold start holds for as
        long as it runs (seconds), and storing them is a network call: both happen on
        threads, so the event loop keeps heartbeating the last *stored* state and
        Temporal never mistakes a node that is recovering for a dead worker.
        """
        partial = _PartialTokens(handle, resumed, functools.partial(self._store_partial, partial_key))
        if not handle.done():
            ended = _ended_event(handle).wait()
            await heartbeating(ended, every_s=_heartbeat_every(), details=partial.advance, at_start=True)
        await partial.settled()
        return await asyncio.to_thread(handle.result, 0), partial.stored

    async def _replay_turn(
        self, turn: BegunTurn, args: GenerateArgs, kept: SampledTokens, at: int, last_beat: PartialTokens
    ) -> RecoveryReplay:
        """The turn generated again on this node from its start, uninterrupted, compared with
        the tokens it kept (`at`: its first token generated after a recovery). Only a turn a
        recovery interrupted pays for this: nothing when nothing failed. Heartbeats go on
        carrying the last stored tokens, so a retry resumes the turn as it would have."""
        spec = _sampling_spec(args.sampling, args.max_tokens_after(turn.prefix))
        try:
            handle = await asyncio.to_thread(self.node.submit, turn.context, spec, f"{_attempt_id()}/replay")
        except RolloutError as exc:
            return not_compared(kept, at, f"the replay was refused: {exc}")
        try:
            await heartbeating(
                _ended_event(handle).wait(), every_s=_heartbeat_every(), details=lambda: last_beat
            )
            replayed = await asyncio.to_thread(handle.result, 0)
        except asyncio.CancelledError:
            self.node.cancel(handle.request_id, "activity cancelled")
            raise
        except RolloutError as exc:
            return not_compared(kept, at, f"the replay failed: {exc}")
        if replayed.recoveries:
            return not_compared(
                kept, at, f"the replay was interrupted too ({', '.join(replayed.recoveries)})"
            )
        return compare_replay(kept, _sampled(replayed), at)

    def _store_partial(self, key: str, sampled: SampledTokens) -> PartialTokens:

        ref = self.store.put_bytes(key, encode_sampled(sampled))
        return PartialTokens(tokens=len(sampled), key=key, sha256=ref.sha256)

    def _resumed(self, partial: PartialTokens) -> SampledTokens:
        """The tokens (with logprobs and versions) a previous attempt stored and
        heartbeated as `partial`; none when the object does not verify or decode (the turn
        then starts over: same tokens, more time)."""

        try:
            sampled = decode_sampled(self.store.get_bytes(partial.key, expected_sha256=partial.sha256))
        except (StorageError, ValueError):
            return SampledTokens()
        return sampled.first(partial.tokens)


class _PartialTokens:
    """The tokens a request has produced so far, stored as they grow: each heartbeat
    (`advance`) reads them on a thread, starts storing them when they grew and nothing is
    being stored, and carries the last *stored* state."""

    def __init__(self, handle, resumed: SampledTokens, store: Callable[[SampledTokens], PartialTokens]):
        self.handle, self.resumed, self.store = handle, resumed, store
        self.stored = PartialTokens(tokens=0)
        self.reading: asyncio.Future | None = None
        self.storing: asyncio.Future | None = None

    def advance(self) -> dict:
        if self.reading is None:
            self.reading = asyncio.ensure_future(asyncio.to_thread(_sampled_so_far, self.handle))
        if self.reading.done():
            seen = self.resumed + self.reading.result()
            self.reading = None
            if self.storing is None and len(seen) > self.stored.tokens:
                self.storing = asyncio.ensure_future(asyncio.to_thread(self.store, seen))
        if self.storing is not None and self.storing.done():
            self.stored = self.storing.result() if self.storing.exception() is None else self.stored
            self.storing = None
        return self.stored.model_dump()

    async def settled(self) -> None:
        """Once the reads and writes under way are done (their failures ignored)."""
        for pending in (self.reading, self.storing):
            if pending is not None:
                await asyncio.gather(pending, return_exceptions=True)


@dataclass
class BegunTurn:
    """A turn whose request is with the engine (`request` None: nothing left to generate)."""

    prefix: PrefixRef
    context: list[int]
    resumed: SampledTokens
    request: RequestHandle | None
    observation: StartedAppend | None


def first_recovery(resumed: int, recovered_at: tuple[int, ...]) -> int | None:
    """The turn's first token generated after an engine recovery, or None when none
    interrupted it: a retried attempt went on after the `resumed` tokens its predecessor
    stored, and the node re-prefilled its request after `recovered_at[i]` of its own tokens
    at each takeover or cold start. A recovery before the turn's first token changes
    nothing: an uninterrupted request prefills its prompt too."""
    positions = ([resumed] if resumed else []) + [resumed + at for at in recovered_at if resumed + at]
    return min(positions, default=None)


def compare_replay(kept: SampledTokens, replayed: SampledTokens, at: int) -> RecoveryReplay:
    """What a replay of a recovered turn says about the tokens the turn kept."""
    if set(replayed.versions) != set(kept.versions) or len(set(kept.versions)) > 1:
        return not_compared(kept, at, "weights were published during the turn or since: other weights")
    shorter = min(len(kept), len(replayed))
    differ = next((i for i in range(shorter) if kept.tokens[i] != replayed.tokens[i]), None)
    if differ is None and len(kept) != len(replayed):
        differ = shorter
    if differ is None:
        return RecoveryReplay(position=at, tokens_after=len(kept) - at, outcome="same")
    return RecoveryReplay(
        position=at,
        tokens_after=len(kept) - at,
        outcome="differs",
        first_difference=differ,
        detail=f"token {differ}: kept {_token_at(kept, differ)}, the replay drew {_token_at(replayed, differ)}",
    )


def not_compared(kept: SampledTokens, at: int, why: str) -> RecoveryReplay:
    return RecoveryReplay(position=at, tokens_after=len(kept) - at, outcome="not_compared", detail=why)


def _token_at(sampled: SampledTokens, position: int) -> str:
    if position >= len(sampled):
        return "nothing (it ended there)"
    return f"{sampled.tokens[position]} (logprob {sampled.logprobs[position]:.6f})"


def _sampling_spec(sampling: SamplingParams, max_tokens: int):

    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        stop=tuple(sampling.stop),
        ignore_eos=sampling.ignore_eos,
    )


def _heartbeated_partial() -> PartialTokens | None:
    """What an earlier attempt of this turn last heartbeated, when it stored tokens; None
    on a first attempt, or when the details do not parse or name nothing stored."""
    details = activity.info().heartbeat_details
    if not details:
        return None
    try:
        partial = PartialTokens.model_validate(details[-1])
    except ValueError:
        return None
    return partial if partial.key is not None and partial.tokens > 0 else None


def _ended_event(handle) -> asyncio.Event:
    """An event of the running loop that the node's thread sets when `handle` ends."""
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()

    def wake() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(ended.set)

    handle.when_done(wake)
    return ended


def _sampled(completion) -> SampledTokens:
    return SampledTokens(completion.token_ids, completion.logprobs, completion.versions)


def _sampled_so_far(handle) -> SampledTokens:
    """The request's tokens so far with their logprobs and versions. The tokens are read
    first: the lists read after them are at least as long, so cutting them to the tokens'
    length gives equal, consistent prefixes."""
    tokens = handle.tokens_so_far()
    count = len(tokens)
    return SampledTokens(tokens, handle.logprobs_so_far()[:count], handle.versions_so_far()[:count])


def _heartbeat_every() -> float:
    timeout = activity.info().heartbeat_timeout
    if timeout is None:
        return MAX_HEARTBEAT_EVERY_S
    return max(0.05, min(MAX_HEARTBEAT_EVERY_S, timeout.total_seconds() / 2))


def _attempt_id() -> str:
    info = activity.info()
    return f"{info.workflow_id}/{info.activity_id}/{info.attempt}"


def _partial_key(prefix: PrefixRef) -> str:
    return partial_key(prefix, activity.info().activity_id)


def partial_key(prefix: PrefixRef, activity_id: str) -> str:
    """Where one turn's tokens so far live: beside the token log, one object per activity
    (every attempt of it overwrites the same object). An agent session's stream reads it
    (belayer/serve/sessions.py)."""
    return f"{prefix.key}.partial/{activity_id}-{prefix.length}"
