"""Context activities: turn text (the task prompt, an observation) into token-log appends.

The workflow never holds token ids. It asks these activities to start a trajectory's
token log from its prompt, and to append an observation (its text, capped by the sandbox)
before the next generation. They run on any worker that has the model's tokenizer.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

from pydantic import BaseModel, Field
from temporalio import activity

from belayer.storage.tokenlog import PrefixRef

OBSERVATION_TEMPLATE = "\n<observation>\n{body}\n</observation>\n"
PROMPT_TEMPLATE = (
    "You are an agent working in a Linux sandbox. Run a command with <bash>COMMAND</bash>; "
    "answer without a tool call when you are done.\nTask: {instruction}\n"
)


class StartContextArgs(BaseModel):
    """A new token log at `log_key` holding the rendered prompt."""

    log_key: str = Field(min_length=1)
    instruction: str


class AppendObservationArgs(BaseModel):
    """Append an observation's text (already capped by the sandbox) after `prefix`.

    When `fork_to` is set the append goes to a new log forked from `prefix` (a context
    cut after a restore): the old log keeps its history, untouched.
    """

    prefix: PrefixRef
    text: str
    fork_to: str | None = None


class ContextResult(BaseModel):
    prefix: PrefixRef
    appended_tokens: int


class ContextActivities:
    """Bound to one object store and one tokenizer (a worker's)."""

    def __init__(self, store, tokenizer_path: Path):
        self.store = store
        self.tokenizer_path = tokenizer_path

    @functools.cached_property
    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_path))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @activity.defn(name="start_context")
    async def start_context(self, args: StartContextArgs) -> ContextResult:
        return await asyncio.to_thread(self._start_context, args)

    @activity.defn(name="append_observation")
    async def append_observation(self, args: AppendObservationArgs) -> ContextResult:
        return await asyncio.to_thread(self._append_observation, args)

    def _start_context(self, args: StartContextArgs) -> ContextResult:
        from belayer.storage.tokenlog import TokenLog

        tokens = self.encode(PROMPT_TEMPLATE.format(instruction=args.instruction))
        log = TokenLog.create(self.store, args.log_key)
        return ContextResult(prefix=log.append(tokens), appended_tokens=len(tokens))

    def _append_observation(self, args: AppendObservationArgs) -> ContextResult:
        from belayer.storage.tokenlog import TokenLog

        tokens = self.encode(OBSERVATION_TEMPLATE.format(body=args.text))
        if args.fork_to:
            log = TokenLog.fork(self.store, args.prefix, args.fork_to)
        else:
            log = TokenLog.resume(self.store, args.prefix)
        return ContextResult(prefix=log.append(tokens), appended_tokens=len(tokens))
