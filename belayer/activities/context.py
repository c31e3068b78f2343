"""Context activities: turn text (the task prompt, an observation) into token-log appends,
and keep the trajectory's log (steps, decisions, recoveries) in the object store.

The workflow never holds token ids or observation texts. It asks these activities to
start a trajectory's token log from its prompt, and after every action to append the
stored observation (its text, capped by the sandbox) before the next generation -- both
marked "env" in the log, so a trainer's loss mask leaves them out -- the
same call records the step and any completed decisions and recoveries in the
trajectory's log, so a step costs no extra activity. Mostly that append runs inside the
next turn's `generate` on the rollout node (`GenerateArgs.observation`), through
`prepare_append`, its writes beside the generation; the activity appends an observation
nothing generates after.
They run on any worker that has the model's tokenizer and the object store (wrapped for
archive encryption when configured, since observations and log records are encrypted at
rest); the workflow runs them as local activities of its own worker.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from belayer import trajectory_log
from belayer.activities.runtime import implements
from belayer.agent_format import OBSERVATION_TEMPLATE, PROMPT_TEMPLATE, observation_text
from belayer.contracts.context import (
    APPEND_OBSERVATION,
    EXTEND_CONTEXT,
    FLUSH_LOG,
    FORK_CONTEXT,
    START_CONTEXT,
    AppendObservationArgs,
    ContextResult,
    ExtendContextArgs,
    ExtendContextResult,
    FlushLogArgs,
    ForkContextArgs,
    StartContextArgs,
)
from belayer.sandbox.observations import load_observation
from belayer.storage.tokenlog import TokenLog, decode_tokens, encode_tokens, prefix_ref, read_prefix


class ContextActivities:
    """Bound to one object store and one tokenizer (a worker's)."""

    def __init__(self, store, tokenizer_path: Path):
        self.store = store
        self.tokenizer_path = tokenizer_path
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="belayer-context")

    @functools.cached_property
    def tokenizer(self):

        return Tokenizer.from_file(str(self.tokenizer_path))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @implements(START_CONTEXT)
    async def start_context(self, args: StartContextArgs) -> ContextResult:
        return await asyncio.to_thread(self._start_context, args)

    @implements(FORK_CONTEXT)
    async def fork_context(self, args: ForkContextArgs) -> ContextResult:
        return await asyncio.to_thread(self._fork_context, args)

    @implements(APPEND_OBSERVATION)
    async def append_observation(self, args: AppendObservationArgs) -> ContextResult:
        return await asyncio.to_thread(self._append_observation, args)

    @implements(FLUSH_LOG)
    async def flush_log(self, args: FlushLogArgs) -> None:
        await asyncio.to_thread(trajectory_log.write_entries, self.store, args.trajectory_id, args.entries)

    @implements(EXTEND_CONTEXT)
    async def extend_context(self, args: ExtendContextArgs) -> ExtendContextResult:
        return await asyncio.to_thread(self._extend_context, args)

    def all(self) -> list:
        return [
            self.start_context,
            self.fork_context,
            self.append_observation,
            self.flush_log,
            self.extend_context,
        ]

    def _start_context(self, args: StartContextArgs) -> ContextResult:

        tokens = (
            []
            if args.instruction is None
            else self.encode(PROMPT_TEMPLATE.format(instruction=args.instruction))
        )
        log = TokenLog.create(self.store, args.log_key)
        if not args.prompt_only:
            trajectory_log.start_log(self.store, args.trajectory_id, args.steps_key)
        return ContextResult(prefix=log.append(tokens, source="env"), appended_tokens=len(tokens))

    def _fork_context(self, args: ForkContextArgs) -> ContextResult:

        log = TokenLog.fork(self.store, args.prefix, args.log_key)
        trajectory_log.start_log(self.store, args.trajectory_id, args.steps_key, steps_from=args.steps_from)
        return ContextResult(prefix=log.head, appended_tokens=0)

    def _append_observation(self, args: AppendObservationArgs) -> ContextResult:
        return self.start_append(args).wait()

    def _extend_context(self, args: ExtendContextArgs) -> ExtendContextResult:
        """The client's prompt as the context. The tokens already logged are kept as they
        were generated (the prompt re-tokenized them the same way, or it is a cut): what a
        trainer reads is what the engine sampled, never a re-encoding of its text."""
        prompt = decode_tokens(self.store.get_bytes(args.prompt.key, expected_sha256=args.prompt.sha256))
        logged = read_prefix(self.store, args.prefix)
        kept = _common_prefix_length(logged, prompt)
        cut = kept < len(logged)
        if cut:
            log = TokenLog.fork(self.store, prefix_ref(args.prefix.key, logged[:kept]), args.fork_to)
        else:  # the log just read and verified goes on: not read again
            log = TokenLog(self.store, args.prefix.key, prefix=encode_tokens(logged))
        head = log.append(prompt[kept:], source="env")
        return ExtendContextResult(prefix=head, appended_tokens=len(prompt) - kept, kept_tokens=kept, cut=cut)

    def start_append(self, args: AppendObservationArgs) -> StartedAppend:
        """`prepare_append`, then its writes started."""
        return self.prepare_append(args).start()

    def prepare_append(self, args: AppendObservationArgs) -> PreparedAppend:
        """Read the observation and the context's head (in parallel) and tokenize: the tokens
        and the ref the append gives, nothing written yet. `start` then writes the tokens,
        the step and the entries (in parallel) and returns without waiting for them: the
        rollout node hands the tokens to its engine between the two, so the generation
        starts before the writes do and runs beside them. Each write is idempotent and the
        workflow counts a step only once the writes are done, so their order does not matter."""

        def open_log() -> TokenLog:
            if args.fork_to:
                return TokenLog.fork(self.store, args.prefix, args.fork_to)
            return TokenLog.resume(self.store, args.prefix)

        def write_step() -> None:
            if args.steps_fork_from is not None:
                trajectory_log.start_steps(self.store, args.steps_key, fork_from=args.steps_fork_from)
            trajectory_log.write_step(self.store, args.steps_key, args.step)

        if args.append_tokens:
            reading = [
                self._pool.submit(load_observation, self.store, args.step.observation),
                self._pool.submit(open_log),
            ]
            observation, log = (future.result() for future in reading)
            tokens = self.encode(OBSERVATION_TEMPLATE.format(body=observation_text(observation)))
        else:
            log, tokens = open_log(), []

        def start_writes() -> list[Future]:
            return [
                self._pool.submit(log.append, tokens, source="env"),
                self._pool.submit(write_step),
                self._pool.submit(trajectory_log.write_entries, self.store, args.trajectory_id, args.entries),
            ]

        result = ContextResult(prefix=log.head_after(tokens), appended_tokens=len(tokens))
        return PreparedAppend(result, tokens, start_writes)


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    shorter = min(len(a), len(b))
    return next((i for i in range(shorter) if a[i] != b[i]), shorter)


@dataclass
class PreparedAppend:
    """An observation's append, read and tokenized, its writes not started."""

    result: ContextResult
    tokens: list[int]
    start_writes: Callable[[], list[Future]]

    def start(self) -> StartedAppend:
        return StartedAppend(self.result, self.tokens, self.start_writes())


@dataclass
class StartedAppend:
    """An observation's append whose writes may still be running."""

    result: ContextResult
    tokens: list[int]
    writes: list[Future]

    def wait(self) -> ContextResult:
        """The result, once every write is done (the first failure raises)."""
        for write in self.writes:
            write.result()
        return self.result
