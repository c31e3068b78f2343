"""`belayer serve`'s HTTP endpoint: OpenAI's `/v1/chat/completions` and `/v1/completions`
over agent sessions, plus the session calls an OpenAI API has no words for.

    POST /v1/sessions                 {"task": ID, "seed": 0, "temperature": 1.0, "group_size": 1}
    POST /v1/chat/completions         header X-Session-ID (and X-Request-ID to make a retry safe)
    POST /v1/completions              the same, the client rendering its own prompt
    POST /v1/sessions/{id}/exec       {"command": "..."}: the agent's action in its sandbox
    POST /v1/sessions/{id}/finish     the task's check, the reward, the rollout's summary
    POST /v1/sessions/{id}/branch     {"at_step": K, "count": N}: sessions going on after its step K
    GET  /v1/sessions/{id}            where the session stands
    GET  /v1/models

Every answer is the session workflow's (belayer/serve/sessions.py): an engine that fails
during a call is recovered by the rollout node (takeover, prefix replay) or the call's
activity is retried on another node, resuming mid-turn; the client sees a slower answer,
never an error. `n` is 1; tool calls stay text in the chat template
(`belayer.agent_format.render_chat`). `stream: true` answers as server-sent events, the
text as the turn's stored tokens grow (`Sessions.stream` says how often, and why only
those).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from belayer.agent_format import observation_text, render_chat
from belayer.serve.sessions import Generated, SessionError, Sessions
from belayer.workloads.models import Task

TASK_ADAPTER: TypeAdapter = TypeAdapter(Task)
STATUS_OF_KIND = {"bad_request": 400, "not_found": 404, "ended": 409, "infra": 503}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields this endpoint does not use


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=32768)
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float | None = Field(None, ge=0, le=5)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1, description="One choice per call: a session is one trajectory.")
    stream: bool = False
    ignore_eos: bool = Field(
        False, description="vLLM's extension: generate max_tokens whatever the model says."
    )
    return_token_ids: bool = Field(False, description="vLLM's extension: the turn's token ids in the answer.")

    def limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 256

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatBody(_Sampling):
    messages: list[dict] = Field(min_length=1)


class CompletionBody(_Sampling):
    prompt: str | list[int]


class SessionBody(_Body):
    task: str | dict = Field(
        description="A task of the served workloads by id, or a task itself (a model or trace task, "
        "as a workload file writes one)."
    )
    seed: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0, le=5)
    session_id: str | None = Field(
        None, min_length=1, max_length=170, description="A group's: its members' prefix."
    )
    keep_checkpoints: bool = Field(False, description="Keep its checkpoints when it ends, for branches.")
    group_size: int = Field(
        1,
        ge=1,
        le=256,
        description="More than 1: a group whose sandboxes fork one set-up sandbox (session_ids).",
    )


class BranchBody(_Body):
    at_step: int = Field(ge=1, description="The parent's step after which the branches go on.")
    count: int = Field(1, ge=1, le=64)


class ExecBody(_Body):
    command: str = Field(min_length=1)


def create_app(sessions: Sessions, tasks: dict[str, Task]) -> FastAPI:
    app = FastAPI(title="Belayer", summary="OpenAI-compatible endpoint over durable agent sessions")
    model_name = sessions.config.rollout.model

    @app.exception_handler(SessionError)
    async def _session_error(_: Request, err: SessionError) -> JSONResponse:
        return _error(STATUS_OF_KIND.get(err.kind, 500), str(err), err.kind)

    @app.exception_handler(ValidationError)
    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: Exception) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        return _error(400, f"the request does not parse: {problems}", "bad_request")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "belayer"}]}

    @app.post("/v1/sessions")
    async def start(body: SessionBody) -> dict:
        task = _task(body.task, tasks)
        if body.group_size > 1:
            members = await sessions.start_group(task, body.group_size, seed=body.seed, temperature=body.temperature,
                                                 group_id=body.session_id)  # fmt: skip
            return dataclasses.asdict(members[0]) | {"session_ids": [m.session_id for m in members]}
        started = await sessions.start(task, seed=body.seed, temperature=body.temperature, session_id=body.session_id,
                                       keep_checkpoints=body.keep_checkpoints)  # fmt: skip
        return dataclasses.asdict(started)

    @app.post("/v1/sessions/{session_id}/branch")
    async def branch(session_id: str, body: BranchBody) -> dict:
        branched = await sessions.branch(session_id, body.at_step, body.count)
        observation = branched.observation
        return {
            "session_ids": [s.session_id for s in branched.sessions],
            "context_text": branched.context_text,
            "observation": {"exit_code": observation.exit_code, "output": observation_text(observation)},
        }

    @app.get("/v1/sessions/{session_id}")
    async def view(session_id: str) -> dict:
        return (await sessions.view(session_id)).model_dump(mode="json")

    @app.post("/v1/sessions/{session_id}/exec")
    async def exec_(session_id: str, body: ExecBody, x_request_id: str | None = Header(None)) -> dict:
        step, observation = await sessions.exec(session_id, body.command, request_id=x_request_id)
        return {"step": step, "exit_code": observation.exit_code, "stdout": observation.stdout,
                "stderr": observation.stderr, "output": observation_text(observation)}  # fmt: skip

    @app.post("/v1/sessions/{session_id}/finish")
    async def finish(session_id: str) -> dict:
        result, rollout = await sessions.finish(session_id)
        return {
            "session_id": session_id,
            "task": result.task,
            "status": result.status,
            "reward": result.reward,
            "rewards": result.rewards,
            "reason": result.reason,
            "turns": result.turns,
            "recoveries": [r.model_dump(mode="json") for r in result.recoveries],
            "prompt_tokens": len(rollout.prompt_ids),
            "completion_tokens": len(rollout.completion_ids),
            "model_tokens": sum(rollout.loss_mask),
            "token_sha256": result.token_sha256,
            "env_sha256": result.env_sha256,
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatBody, x_session_id: str | None = Header(None),
                   x_request_id: str | None = Header(None)) -> dict | StreamingResponse:  # fmt: skip
        try:
            prompt = render_chat(body.messages)
        except ValueError as err:
            raise SessionError(f"messages: {err}", "bad_request") from None
        return await _respond(
            sessions, _session(x_session_id), prompt, body, x_request_id, model_name, chat=True
        )

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, x_session_id: str | None = Header(None),
                          x_request_id: str | None = Header(None)) -> dict | StreamingResponse:  # fmt: skip
        return await _respond(sessions, _session(x_session_id), body.prompt, body, x_request_id, model_name,
                              chat=False)  # fmt: skip

    return app


def _task(named: str | dict, tasks: dict[str, Task]) -> Task:
    """The served task `named`, or the task it is."""
    if isinstance(named, dict):
        try:
            task = TASK_ADAPTER.validate_python(named)
        except ValidationError as err:
            raise SessionError(f"the task does not parse: {err}", "bad_request") from None
        if task.kind not in ("model", "trace"):
            raise SessionError(
                f"a {task.kind} task is prepared by `belayer serve --workload PATH`, not sent", "bad_request"
            )
        return task
    if named not in tasks:
        known = (
            ", ".join(sorted(tasks))
            or "none: start `belayer serve` with --workload PATH, or send the task itself"
        )
        raise SessionError(f"no task {named!r} in the served workloads (known: {known})", "not_found")
    return tasks[named]


def _session(header: str | None) -> str:
    if not header:
        raise SessionError(
            "no X-Session-ID header: start a session with POST /v1/sessions and send its id in X-Session-ID",
            "bad_request",
        )
    return header


async def _respond(sessions: Sessions, session_id: str, prompt, body: _Sampling, request_id: str | None,
                   model: str, *, chat: bool) -> dict | StreamingResponse:  # fmt: skip
    sampling = {"max_tokens": body.limit(), "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
                "stop": body.stops(), "ignore_eos": body.ignore_eos}  # fmt: skip
    answer, ids = _Answer(model, chat), body.return_token_ids
    if not body.stream:
        return answer.whole(
            await sessions.generate(session_id, prompt, request_id=request_id, token_ids=ids, **sampling)
        )
    deltas = sessions.stream(session_id, prompt, request_id=request_id, token_ids=ids, **sampling)
    first = await anext(
        deltas
    )  # a session that is unknown, ended or refuses the call answers with its status
    return StreamingResponse(answer.events(first, deltas), media_type="text/event-stream")


class _Answer:
    """One call's answer in OpenAI's shapes: whole, or as a stream of server-sent chunks."""

    def __init__(self, model: str, chat: bool):
        self.chat = chat
        self.kind = "chat.completion" if chat else "text_completion"
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"
        self.common = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                       "model": model}  # fmt: skip

    def whole(self, generated: Generated) -> dict:
        reply = generated.reply
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": reply.text},
                      "finish_reason": reply.finish_reason}  # fmt: skip
        else:
            choice = {"index": 0, "text": reply.text, "finish_reason": reply.finish_reason, "logprobs": None}
        return {**self.common, "object": self.kind, "choices": [choice], **self._tail(generated)}

    async def events(
        self, first: str | Generated, rest: AsyncIterator[str | Generated]
    ) -> AsyncIterator[str]:
        """The text as it comes (the first chunk carries the role), then the end with the usage."""
        if self.chat:
            yield self._chunk(
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            )
        item = first
        try:
            while isinstance(item, str):
                yield self._chunk(self._delta(item))
                item = await anext(rest)
        except SessionError as err:
            yield f"data: {json.dumps({'error': {'message': str(err), 'type': err.kind}})}\n\n"
            return
        end = self._delta("") | {"finish_reason": item.reply.finish_reason}
        yield self._chunk(end, **self._tail(item))
        yield "data: [DONE]\n\n"

    def _delta(self, text: str) -> dict:
        if self.chat:
            return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": None}
        return {"index": 0, "text": text, "finish_reason": None, "logprobs": None}

    def _chunk(self, choice: dict, **extra) -> str:
        return f"data: {json.dumps({**self.common, 'object': self.chunk_kind, 'choices': [choice], **extra})}\n\n"

    @staticmethod
    def _tail(generated: Generated) -> dict:
        reply = generated.reply
        usage = {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
                 "total_tokens": reply.prompt_tokens + reply.completion_tokens}  # fmt: skip
        belayer = {"context_cut": reply.context_cut, "kept_tokens": reply.kept_tokens,
                   "engine_recoveries": reply.engine_recoveries, "timing": reply.timing.model_dump()}  # fmt: skip
        if generated.token_ids is not None:
            belayer["token_ids"] = generated.token_ids
        return {"usage": usage, "belayer": belayer}


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


@contextlib.asynccontextmanager
async def serve_in_background(sessions: Sessions, tasks: dict[str, Task]):
    """The endpoint `belayer serve` runs, served by this process on a free local port while
    the block runs (a benchmark, a test); yields its base URL."""
    server = uvicorn.Server(uvicorn.Config(create_app(sessions, tasks), host="127.0.0.1",
                                           port=free_port(), log_level="warning"))  # fmt: skip
    serving = asyncio.create_task(server.serve())
    while not server.started:
        if serving.done():
            serving.result()
        await asyncio.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}/v1"
    finally:
        server.should_exit = True
        await serving


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
