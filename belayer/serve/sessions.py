"""Agent sessions on a running stack: what `belayer serve`'s endpoint does for each request,
usable from Python as well.

    sessions = await Sessions.connect()
    started = await sessions.start(task, seed=0)
    reply = await sessions.generate(started.session_id, prompt_text, request_id="r1")
    observation = await sessions.exec(started.session_id, "ls /workspace")
    rollout = await sessions.finish(started.session_id)

A session is one `AgentSessionWorkflow` (belayer/workflows/session.py), its id the
trajectory's. A prompt reaches it by pointer: its tokens are written to the object store
here and the workflow's context activity appends them. When the prompt's text starts with
the text of what the session logged, the logged tokens are kept as the engine sampled
them and only the rest is tokenized ("tokens in, tokens out"): decoding and re-encoding a
model's turn can give other ids, and a trainer must train on the ids that were sampled.
Anything else is the client rewriting its context, and the workflow records a cut.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from temporalio.client import (
    Client,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
    WorkflowUpdateStage,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from tokenizers import Tokenizer

from belayer.activities.generate import partial_key
from belayer.branching import branch_inputs
from belayer.client import start_group, start_trajectory, task_queues, trajectory_input
from belayer.config import BelayerConfig, load_config
from belayer.contracts.context import TokensRef
from belayer.contracts.errors import BAD_REQUEST
from belayer.errors import BelayerError
from belayer.model.build import model_path
from belayer.sandbox.observations import Observation, load_observation
from belayer.storage.errors import StorageError
from belayer.storage.generation import decode_sampled
from belayer.storage.store import open_store
from belayer.storage.tokenlog import PrefixRef, encode_tokens, read_prefix
from belayer.temporal_client import connect
from belayer.trainer.models import RolloutRef
from belayer.trainer.rollout import Rollout, read_rollout
from belayer.workflows.groups import GroupInput
from belayer.workflows.models import Sampling, TrajectoryInput, TrajectoryResult
from belayer.workflows.session import SESSION_ENDED
from belayer.workflows.session_models import (
    ExecCall,
    ExecReply,
    FinishCall,
    FinishReply,
    GenerateCall,
    GenerateReply,
    SessionView,
)
from belayer.workloads.harbor_tasks import runnable_workload
from belayer.workloads.models import Task
from belayer.workloads.registry import driver_for

# How often a stream looks for the running turn's stored tokens.
STREAM_POLL_S = 0.25


class SessionError(BelayerError):
    """A call a session could not take. `kind`: "bad_request" (the caller's input; the
    session goes on), "not_found", "ended" (finished or failed: start a new one), "infra"."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class StartedSession:
    session_id: str
    task: str
    instruction: str
    turn_limit: int
    max_tokens_per_turn: int


@dataclass(frozen=True)
class Branched:
    """Branches of a session: the new sessions, and where their client goes on from."""

    sessions: list[StartedSession]
    context_text: str  # the parent's context when the step's command ran, as text
    observation: Observation  # what that command gave


@dataclass(frozen=True)
class Generated:
    """One generate call's answer, and the ids of the turn's tokens (read from the token log)."""

    reply: GenerateReply
    token_ids: list[int] | None  # None: not asked for


class Sessions:
    """Agent sessions of the stack `config` names."""

    def __init__(self, config: BelayerConfig, client: Client) -> None:
        self.config = config
        self.temporal = client
        self.queues = task_queues(config)
        self.store = open_store(config.storage)  # observations are encrypted at rest when configured
        self.tokens = open_store(config.storage, encrypted=False)  # token logs and prompts never are

    @classmethod
    async def connect(cls, config: BelayerConfig | None = None) -> Sessions:
        config = config or load_config()
        return cls(config, await connect(config.temporal, config.storage.encryption_key))

    def close(self) -> None:
        self.store.close()
        self.tokens.close()

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(
            str(model_path(self.config.rollout.model, self.config.cache_dir) / "tokenizer.json")
        )

    # ------------------------------------------------------------------ the calls

    async def start(self, task: Task, *, seed: int = 0, temperature: float = 1.0, session_id: str | None = None,
                    keep_checkpoints: bool = False) -> StartedSession:  # fmt: skip
        """Start a session of `task`: its sandbox is set up while the client prepares.
        `keep_checkpoints`: its checkpoints outlive it, for branches to start from."""
        session_id = session_id or f"session-{task.id}-{uuid.uuid4().hex[:8]}"
        input = self._input(task, session_id, seed, temperature, keep_checkpoints)
        await self._start(start_trajectory(self.temporal, self.config, input, workflow="AgentSessionWorkflow",
                                           summary=f"agent session of task {task.id}"))  # fmt: skip
        return self._started(task, session_id)

    async def start_group(self, task: Task, size: int, *, seed: int = 0, temperature: float = 1.0,
                          group_id: str | None = None, ready_within_s: float = 600) -> list[StartedSession]:  # fmt: skip
        """`size` sessions of `task` whose sandboxes fork one set-up sandbox (a GRPO group;
        member k samples from seed + k); returns once every member's session exists."""
        group_id = group_id or f"sessions-{task.id}-{uuid.uuid4().hex[:8]}"
        ids = [f"{group_id}-m{k}" for k in range(size)]
        group = GroupInput(group_id=group_id, members=[self._input(task, i, seed + k, temperature) for k, i in enumerate(ids)],
                           workflow_queue=self.config.temporal.workflow_task_queue,
                           member_workflow="AgentSessionWorkflow")  # fmt: skip
        await self._start(start_group(self.temporal, self.config, group))
        deadline = time.monotonic() + ready_within_s
        for session_id in ids:
            while not await self._exists(session_id):
                if time.monotonic() > deadline:
                    raise SessionError(f"group {group_id}: session {session_id} did not start within {ready_within_s:.0f} s; "
                                       f"see the group's workflow in the Temporal UI", "infra")  # fmt: skip
                await asyncio.sleep(0.2)
        return [self._started(task, i) for i in ids]

    async def branch(self, parent_id: str, at_step: int, count: int = 1) -> Branched:
        """`count` sessions that continue the ended session `parent_id` after its step
        `at_step` (belayer/branching.py): each one's sandbox is restored from the parent's
        latest kept checkpoint at or before it (else rebuilt by replaying its steps) and
        verified, and its token log is the parent's as it stood when that step's command
        ran. Branch i samples from the parent's seed + 1 + i. The client goes on from
        `context_text` and the step's observation: the same conversation up to that
        command, then the command's output as a tool message, extends it."""
        try:
            inputs = await branch_inputs(self.temporal, self.config, parent_id, at_step, count)
        except BelayerError as err:
            raise SessionError(str(err), "bad_request") from None
        for input in inputs:
            await self._start(start_trajectory(self.temporal, self.config, input, workflow="AgentSessionWorkflow",
                                               summary=f"branch of session {parent_id} after step {at_step}"))  # fmt: skip
        at = inputs[0].start_from.at_step
        logged = await asyncio.to_thread(read_prefix, self.tokens, at.context_after_action)
        observation = await asyncio.to_thread(load_observation, self.store, at.observation)
        return Branched(
            sessions=[self._started(input.task, input.trajectory_id) for input in inputs],
            context_text=self.tokenizer.decode(logged, skip_special_tokens=True),
            observation=observation,
        )

    def _input(self, task: Task, session_id: str, seed: int, temperature: float,
               keep_checkpoints: bool = False) -> TrajectoryInput:  # fmt: skip
        return trajectory_input(self.config, task, seed=seed).model_copy(
            update={
                "trajectory_id": session_id,
                "queues": self.queues,
                "sampling": Sampling(seed=seed, temperature=temperature),
                "keep_checkpoints": keep_checkpoints,
            }  # fmt: skip
        )

    async def _start(self, starting) -> None:
        """`starting` (a workflow's start), an id in use said as the caller's mistake."""
        try:
            await starting
        except RPCError as err:
            if err.status == RPCStatusCode.ALREADY_EXISTS:
                raise SessionError(f"{err.message or err}: choose another id", "bad_request") from None
            raise

    @staticmethod
    def _started(task: Task, session_id: str) -> StartedSession:
        driver = driver_for(task)
        return StartedSession(session_id, task.id, driver.instruction(task), driver.turn_limit(task),
                              driver.sampling(task, 0).max_tokens)  # fmt: skip

    async def view(self, session_id: str) -> SessionView:
        return await self._call(
            self._handle(session_id).query("session", result_type=SessionView), session_id
        )

    async def generate(self, session_id: str, prompt: str | list[int], *, request_id: str | None = None,
                       token_ids: bool = True, **sampling) -> Generated:  # fmt: skip
        """Generate after `prompt` (text, or token ids), the session's whole context as the
        client sees it. The same `request_id` again gets the first call's answer.
        `sampling`: `GenerateCall`'s fields (max_tokens, temperature, top_p, seed, stop, ignore_eos).
        `token_ids`: read the turn's ids back from the token log (one more read)."""
        request_id, call = await self._generate_call(session_id, prompt, request_id, sampling)
        reply = await self._update(session_id, request_id, call, GenerateReply)
        return await self._generated(reply, token_ids)

    async def stream(self, session_id: str, prompt: str | list[int], *, request_id: str | None = None,
                     token_ids: bool = True, **sampling) -> AsyncIterator[str | Generated]:  # fmt: skip
        """`generate`, its text as it grows (str deltas), then the `Generated`. The text comes
        from the tokens the turn has stored so far (its activity stores them about once a
        second, for a retry to resume from): a stream shows what is durable, never a
        token a recovery could take back, and a turn shorter than a second comes whole.
        With stop strings, the text comes at the end only: a stop string cuts what
        precedes it, and a delta sent cannot be unsent."""
        request_id, call = await self._generate_call(session_id, prompt, request_id, sampling)
        handle = self._handle(session_id)
        update = await self._call(
            handle.start_update("call", call, id=f"call-{request_id}", result_type=GenerateReply,
                                wait_for_stage=WorkflowUpdateStage.ACCEPTED), session_id)  # fmt: skip
        answered = asyncio.ensure_future(self._call(update.result(), session_id))
        sent = ""
        try:
            while not answered.done():
                await asyncio.wait({answered}, timeout=STREAM_POLL_S)
                text = None if call.stop or answered.done() else await self._partial_text(session_id)
                if text and text.startswith(sent) and len(text) > len(sent):
                    yield text[len(sent) :]
                    sent = text
            reply = await answered
        finally:
            answered.cancel()
        if len(reply.text) > len(sent):
            yield reply.text[len(sent) :]
        yield await self._generated(reply, token_ids)

    async def _generated(self, reply: GenerateReply, token_ids: bool) -> Generated:
        return Generated(reply, await asyncio.to_thread(self._turn_tokens, reply) if token_ids else None)

    async def _generate_call(self, session_id: str, prompt: str | list[int], request_id: str | None,
                             sampling: dict) -> tuple[str, GenerateCall]:  # fmt: skip
        """The call: the prompt's tokens stored, its sampling checked (a bad field is the caller's)."""
        request_id = request_id or uuid.uuid4().hex
        tokens = prompt
        if isinstance(prompt, str):  # only text needs the logged tokens, to keep them as sampled
            context = (await self.view(session_id)).context
            tokens = await asyncio.to_thread(self._tokens_of, context, prompt)
        if not tokens:
            raise SessionError("the prompt is empty: send the conversation so far", "bad_request")
        ref = await asyncio.to_thread(self._store_prompt, session_id, request_id, tokens)
        try:
            return request_id, GenerateCall(prompt=ref, **sampling)
        except ValidationError as err:
            raise SessionError(f"the sampling parameters do not parse: {err}", "bad_request") from None

    async def _partial_text(self, session_id: str) -> str | None:
        """The text of the tokens the running turn has stored so far (None: none yet), cut
        before an unfinished character. Its activity stores them beside the token log
        about once a second; the heartbeat that names them reaches Temporal's server far
        less often (the SDK throttles it), so the object is read where it is written."""
        try:
            context = (await self.view(session_id)).context
            pending = (await self._handle(session_id).describe()).raw_description.pending_activities
            running = [p.activity_id for p in pending if p.activity_type.name == "generate"]
            if context is None or not running:
                return None
            data = await asyncio.to_thread(self.tokens.get_bytes, partial_key(context, running[0]))
            tokens = decode_sampled(data).tokens
        except (RPCError, SessionError, StorageError, ValueError):
            return None  # not stored yet, or gone with the turn's end: the next poll or the answer
        return self.tokenizer.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")

    async def exec(
        self, session_id: str, command: str, *, request_id: str | None = None
    ) -> tuple[int, Observation]:
        """Run `command` in the session's sandbox: the step's number and its observation."""
        reply = await self._update(
            session_id, request_id or uuid.uuid4().hex, ExecCall(command=command), ExecReply
        )
        return reply.step, await asyncio.to_thread(load_observation, self.store, reply.observation)

    async def finish(self, session_id: str) -> tuple[TrajectoryResult, Rollout]:
        """End the session: the task's check runs; its result, and the rollout it makes
        (the same `Rollout` the rollout API returns; a failed_infra one has no tokens)."""
        handle = self._handle(session_id)
        try:
            await self._update(session_id, f"finish-{session_id}", FinishCall(), FinishReply)
        except SessionError as err:
            if err.kind != "ended":
                raise
        result = await self._call(handle.result(), session_id)
        rollout = RolloutRef(trajectory_id=session_id, status=result.status, reward=result.reward, attempts=1,
                             reason=result.reason, task=result.task, turns=result.turns,
                             context=None if result.status == "failed_infra" else result.context,
                             recoveries=len(result.recoveries), tokens_after_recovery=result.tokens_after_recovery,
                             recovered_tokens_differ=result.recovered_tokens_differ)  # fmt: skip
        return result, await asyncio.to_thread(read_rollout, self.tokens, rollout)

    # ------------------------------------------------------------------ plumbing

    def _handle(self, session_id: str) -> WorkflowHandle:
        return self.temporal.get_workflow_handle(session_id, result_type=TrajectoryResult)

    async def _update(self, session_id: str, request_id: str, call, reply_type):
        handle = self._handle(session_id)
        return await self._call(
            handle.execute_update("call", call, id=f"call-{request_id}", result_type=reply_type), session_id
        )

    async def _call(self, awaitable, session_id: str):
        """`awaitable`, its failures said as a `SessionError` of the right kind."""
        try:
            return await awaitable
        except WorkflowFailureError as err:
            raise SessionError(f"session {session_id!r} failed: {err.cause or err}", "infra") from None
        except WorkflowUpdateFailedError as err:
            cause = err.cause
            kind = "infra"
            if isinstance(cause, ApplicationError):
                kind = {BAD_REQUEST: "bad_request", SESSION_ENDED: "ended"}.get(cause.type or "", "infra")
            raise SessionError(
                str(cause.message if isinstance(cause, ApplicationError) else cause), kind
            ) from None
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND and await self._exists(session_id):
                raise SessionError(f"session {session_id!r} has ended: start a new one", "ended") from None
            if err.status == RPCStatusCode.NOT_FOUND:
                raise SessionError(
                    f"no session {session_id!r}: start one with POST /v1/sessions", "not_found"
                ) from None
            raise SessionError(f"Temporal refused the call: {err}", "infra") from None

    async def _exists(self, session_id: str) -> bool:
        """Whether the session's workflow exists (an update to one that has closed is NOT_FOUND too)."""
        try:
            await self._handle(session_id).describe()
        except RPCError:
            return False
        return True

    def _tokens_of(self, context: PrefixRef | None, prompt: str) -> list[int]:
        """The prompt's token ids: the session's logged tokens as they are when the prompt's
        text starts with theirs, then the rest tokenized; else the whole text tokenized."""
        logged = read_prefix(self.tokens, context) if context is not None and context.length else []
        text = self.tokenizer.decode(logged, skip_special_tokens=True)
        if logged and prompt.startswith(text):
            return logged + self._encode(prompt[len(text) :])
        return self._encode(prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def _store_prompt(self, session_id: str, request_id: str, tokens: list[int]) -> TokensRef:
        data = encode_tokens(tokens)
        key = f"trajectories/{session_id}/prompts/{request_id}-{hashlib.sha256(data).hexdigest()[:16]}"
        ref = self.tokens.put_bytes(
            key, data
        )  # by content too: a retried request id never rewrites the first
        return TokensRef(key=ref.key, length=len(tokens), sha256=ref.sha256)

    def _turn_tokens(self, reply: GenerateReply) -> list[int]:
        if not reply.completion_tokens:
            return []
        return read_prefix(self.tokens, reply.context)[-reply.completion_tokens :]


def load_tasks(config: BelayerConfig, paths: list[Path]) -> dict[str, Task]:
    """Every task of the workloads (or Harbor task directories) at `paths`, by id, made
    ready to run as `belayer run` makes them."""
    return {task.id: task for path in paths for task in runnable_workload(config, path).tasks}
