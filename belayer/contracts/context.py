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
    instruction: str
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
