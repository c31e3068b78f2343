"""The context activities' contracts: a trajectory's token log started from its prompt or
forked from another context, an observation appended, the trajectory's log entries written
(belayer/activities/context.py says how; `GenerateArgs.observation` carries an append
into the next turn)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from belayer.contracts.activity import Activity
from belayer.storage.recordlog import RecordLogRef
from belayer.storage.tokenlog import PrefixRef
from belayer.trajectory_log import LogEntries, StepRecord


class StartContextArgs(BaseModel):
    """A new token log at `log_key` holding the rendered prompt, and the trajectory's empty
    log (steps at `steps_key`, decisions, recoveries)."""

    log_key: str = Field(min_length=1)
    trajectory_id: str
    steps_key: str = Field(min_length=1, description="Key of the trajectory's first step-log branch.")
    instruction: str | None = Field(
        description="The task's instruction, rendered into Belayer's prompt; None: an empty log "
        "(an agent session's client renders its own prompt, belayer/serve/)."
    )
    prompt_only: bool = Field(
        False,
        description="Only the prompt's token log (a group's, which its members fork): no trajectory log.",
    )


class ForkContextArgs(BaseModel):
    """A trajectory that continues another context: a token log at `log_key` forked from
    `prefix` (a group's shared prompt, or the context a branch continues; nothing is
    copied), and the trajectory's log, its step-log branch inheriting `steps_from` (a
    branch's earlier steps) or empty."""

    log_key: str = Field(min_length=1)
    trajectory_id: str
    steps_key: str = Field(min_length=1)
    prefix: PrefixRef
    steps_from: RecordLogRef | None = None


class AppendObservationArgs(BaseModel):
    """Append the observation of `step` (already capped by the sandbox) after `prefix`, and
    record `step` in the step-log branch `steps_key`.

    When `fork_to` is set the append goes to a new token log forked from `prefix` (a
    context cut after a restore), and `steps_fork_from` starts the new step-log branch
    from the steps the cut keeps: the old logs keep their history, untouched.
    """

    trajectory_id: str
    prefix: PrefixRef
    step: StepRecord
    steps_key: str
    fork_to: str | None = None
    steps_fork_from: RecordLogRef | None = None
    entries: LogEntries = LogEntries()
    append_tokens: bool = Field(
        True,
        description="False: only the step and the entries are recorded, the token log is left as it "
        "is (an agent session's client puts the observation into its next prompt itself).",
    )


class TokensRef(BaseModel):
    """Token ids stored as one object (`encode_tokens`) at `key`: `length` of them, whose
    canonical encoding has sha256 `sha256`. How a prompt an agent session's client rendered
    reaches the workflow: by pointer, never as a token array."""

    key: str = Field(min_length=1)
    length: int = Field(ge=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ExtendContextArgs(BaseModel):
    """Make `prompt` the context: appended after `prefix` when it extends it, else a context
    cut (the client rewrote what it had sent): a new token log at `fork_to` forked from the
    longest common prefix, the rest appended there."""

    prefix: PrefixRef
    prompt: TokensRef
    fork_to: str = Field(min_length=1)


class ExtendContextResult(BaseModel):
    prefix: PrefixRef
    appended_tokens: int
    kept_tokens: int = Field(description="Tokens of the old context the new one starts with.")
    cut: bool = Field(description="The prompt did not extend the context: a new log at `fork_to`.")


class FlushLogArgs(BaseModel):
    """Decisions and recoveries the trajectory's last step left unwritten."""

    trajectory_id: str
    entries: LogEntries


class ContextResult(BaseModel):
    prefix: PrefixRef
    appended_tokens: int


START_CONTEXT = Activity("start_context", StartContextArgs, ContextResult)
FORK_CONTEXT = Activity("fork_context", ForkContextArgs, ContextResult)
APPEND_OBSERVATION = Activity("append_observation", AppendObservationArgs, ContextResult)
FLUSH_LOG = Activity("flush_log", FlushLogArgs, None)
EXTEND_CONTEXT = Activity("extend_context", ExtendContextArgs, ExtendContextResult)
