"""What an agent session (`AgentSessionWorkflow`) is asked and answers: one model per call
kind, pointers and hashes only (the prompt's tokens are an object, `TokensRef`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from belayer.contracts.context import TokensRef
from belayer.contracts.generate import EngineTiming
from belayer.contracts.sandbox import ObservationRef
from belayer.storage.generation import GenerationRef
from belayer.storage.tokenlog import PrefixRef


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateCall(_Model):
    """Generate after `prompt`, the whole context as the client rendered it."""

    kind: Literal["generate"] = "generate"
    prompt: TokensRef
    max_tokens: int = Field(256, ge=1, le=32768)
    temperature: float | None = Field(None, ge=0, le=5, description="None: the session's.")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="None: the session's seed plus the generations so far."
    )
    stop: list[str] = Field(default_factory=list, max_length=16)
    ignore_eos: bool = Field(
        False, description="Generate max_tokens whatever the model says (vLLM's extension)."
    )


class ExecCall(_Model):
    """Run `command` in the session's sandbox, as the agent's next action."""

    kind: Literal["exec"] = "exec"
    command: str = Field(min_length=1, max_length=100_000)


class FinishCall(_Model):
    """The agent is done: the task's check runs and the session ends with its reward."""

    kind: Literal["finish"] = "finish"


SessionCall = GenerateCall | ExecCall | FinishCall


class GenerateReply(_Model):
    text: str
    finish_reason: str
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    context: PrefixRef = Field(description="The session's context after this call's tokens.")
    generation: GenerationRef | None = Field(None, description="The tokens' logprobs and versions.")
    context_cut: bool = Field(
        description="The prompt did not extend the session's logged tokens: a new segment began."
    )
    kept_tokens: int = Field(ge=0, description="Logged tokens the prompt started with.")
    engine_recoveries: list[str] = Field(default_factory=list)
    node_queue: str
    timing: EngineTiming = Field(
        description="The generate activity's: the engine's prefill and decode, its whole attempt."
    )


class ExecReply(_Model):
    step: int = Field(ge=1)
    observation: ObservationRef


class FinishReply(_Model):
    step: int = Field(ge=0, description="Actions the session ran.")


class SessionCut(_Model):
    """A prompt that did not extend what the session had logged (the client rewrote its context)."""

    call: int = Field(ge=1, description="The session's generate call that brought it (1 is the first).")
    kept_tokens: int = Field(ge=0)
    discarded_tokens: int = Field(ge=0)


class SessionView(_Model):
    """What the `session` query says: where the session stands."""

    trajectory_id: str
    task: str
    status: str
    accepting: bool = Field(description="False once finish was asked (or the session ended).")
    step: int
    turn_limit: int
    generations: int
    context: PrefixRef | None
    cuts: list[SessionCut]
