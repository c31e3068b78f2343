"""The sandbox activities' contracts: one *Args and one *Result model per activity, and
the sandbox's value types they carry (defined in belayer/sandbox/models.py, re-exported
here for workflows). Payloads carry handles, refs and hashes, never archives
(belayer/activities/sandbox.py says where each activity runs)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from belayer.contracts.activity import Activity
from belayer.sandbox.models import (
    Action,
    CheckpointRef,
    ForkOutcome,
    ForkTarget,
    ObservationRef,
    RecoverOutcome,
    SandboxHandle,
    SandboxId,
    SandboxSpec,
    StagedCheckpoint,
    StoredFiles,
)
from belayer.storage.recordlog import RecordLogRef
from belayer.trajectory_log import StepRecord

__all__ = [
    "Action",
    "CheckpointRef",
    "ForkOutcome",
    "ForkTarget",
    "ObservationRef",
    "RecoverOutcome",
    "SandboxHandle",
    "SandboxId",
    "SandboxSpec",
    "StagedCheckpoint",
    "CaptureResult",
    "CheckpointArgs",
    "CheckpointResult",
    "CreateSandboxArgs",
    "CreateSandboxResult",
    "DestroyArgs",
    "DestroyResult",
    "ExecArgs",
    "ExecResult",
    "ForkArgs",
    "ForkResult",
    "PlaceArgs",
    "PlaceGroupArgs",
    "PlaceGroupResult",
    "PlaceResult",
    "PublishArgs",
    "RecoverArgs",
    "RecoverResult",
    "WorkspaceHashArgs",
    "WorkspaceHashResult",
    "NextStageArgs",
    "VerifyArgs",
    "VerifyResult",
    "PLACE",
    "PLACE_GROUP",
    "CREATE",
    "EXEC",
    "CHECKPOINT",
    "CAPTURE_CHECKPOINT",
    "PUBLISH_CHECKPOINT",
    "FORK",
    "RECOVER",
    "DESTROY",
    "WORKSPACE_HASH",
    "VERIFY",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateSandboxArgs(_Model):
    spec: SandboxSpec = Field(default_factory=SandboxSpec, description="Setup commands and labels.")
    sandbox_id: SandboxId | None = Field(
        None,
        description="Lineage id chosen by the workflow (workflow.uuid4()) so a retried create replaces "
        "its own earlier attempt instead of leaking it; default: a fresh one.",
    )


class CreateSandboxResult(_Model):
    handle: SandboxHandle


class ExecArgs(_Model):
    handle: SandboxHandle
    action: Action
    isolated: bool = Field(
        False,
        description="Run in a clean process that inherits nothing from the agent's shell "
        "(fixed PATH/HOME/locale, no variables, functions or options of the agent): the reward check.",
    )
    processes: Literal["frozen", "running"] = Field(
        "frozen",
        description="With `isolated`: whether the agent's processes are frozen while the check "
        "runs (and through the workspace hash), or keep running (a task that needs its servers).",
    )


class ExecResult(_Model):
    observation: ObservationRef = Field(
        description="The observation, stored; its text never enters a payload."
    )


class NextStageArgs(_Model):
    """What the next stage of a multi-step task puts in the sandbox, runs, and tells the agent."""

    uploads: dict[str, StoredFiles] = Field(default_factory=dict)
    setup_commands: list[str] = Field(default_factory=list, description="Run as the agent, in order.")
    first_setup_step: int = Field(ge=1, description="Journal step of the first (the setup journal's).")
    min_reward: float | None = Field(None, description="The ending stage's minimum to go on.")
    message: str = Field(description="The observation the agent sees: the verdict and the next instruction.")


class VerifyArgs(_Model):
    """A task's own verifier (Harbor's tests/test.sh): its tests installed at /tests, its logs
    directory emptied, `action` run isolated, the reward read from what it wrote."""

    handle: SandboxHandle
    action: Action = Field(description="The verifier's command, as the trajectory's last step.")
    tests: StoredFiles
    processes: Literal["frozen", "running"] = "running"
    reward_key: str | None = Field(
        None,
        description="With only reward.json: the key that is the reward (default: the mean of its values).",
    )
    artifacts: list[str] = Field(default_factory=list, description="Paths read back after the check.")
    next_stage: NextStageArgs | None = Field(
        None,
        description="A multi-step task's next stage, begun here when this one scored at least its minimum.",
    )


class VerifyResult(_Model):
    observation: ObservationRef = Field(description="The verifier's stdout/stderr, stored.")
    reward: float | None = Field(description="None: the verifier wrote no usable reward (see `reason`).")
    rewards: dict[str, float] = Field(default_factory=dict, description="Every value it wrote.")
    reason: str = Field("", description="Why there is no reward: a timeout, no reward file, a bad one.")
    logs: dict[str, str] = Field(
        default_factory=dict, description="Its logs directory's files: name -> object key (belayer inspect)."
    )
    artifacts: dict[str, str] = Field(
        default_factory=dict, description="The artifacts read back: path in the sandbox -> object key."
    )
    next_observation: ObservationRef | None = Field(
        None, description="The next stage begun: the observation that tells the agent (at the check's step)."
    )
    disk_bytes: int | None = Field(
        None, description="What the sandbox's writable layer held after the check (its storage use)."
    )


class CheckpointArgs(_Model):
    handle: SandboxHandle
    token_prefix_len: int | None = Field(None, ge=0, description="Context length at this step.")
    token_prefix_sha256: str | None = Field(None, description="Hash of that token prefix.")
    fs_snapshot: bool = Field(False, description="Also keep a files-only snapshot (fs-only baseline).")


class CheckpointResult(_Model):
    checkpoint: CheckpointRef


class CaptureResult(_Model):
    staged: StagedCheckpoint = Field(description="The captured archive on its host; publish it there.")


class PublishArgs(_Model):
    staged: StagedCheckpoint


class ForkArgs(_Model):
    checkpoint: CheckpointRef = Field(description="A checkpoint of the set-up sandbox (any lineage).")
    targets: list[ForkTarget] = Field(min_length=1, max_length=256, description="One per fork to start.")
    generation: int = Field(1, ge=1, description="Generation each fork's lineage starts at.")


class ForkResult(_Model):
    forks: list[ForkOutcome] = Field(description="In the order of the targets; a failed one says why.")


class RecoverArgs(_Model):
    handle: SandboxHandle
    trajectory_id: str
    checkpoints: list[CheckpointRef] = Field(default_factory=list, description="Newest first.")
    steps: RecordLogRef = Field(
        description="The trajectory's step log (read here, never sent inline): the actions to replay, their "
        "observation hashes, and the context after each -- a checkpoint whose recorded prefix or journal "
        "disagrees with them is skipped as unusable.",
    )
    spec: SandboxSpec = Field(default_factory=SandboxSpec, description="For a replay from the start.")
    earliest_step: int = Field(
        0,
        ge=0,
        description="No checkpoint before this step, and no replay from the start: a multi-step task's "
        "stage boundary, whose check and files no replay would bring back.",
    )


class RecoverResult(_Model):
    outcome: RecoverOutcome = Field(description="Without the mismatching observation's text (see below).")
    mismatch_observation: ObservationRef | None = Field(None, description="The new observation, stored.")
    mismatch_step: StepRecord | None = Field(None, description="The logged step that no longer matches.")


class PlaceArgs(_Model):
    key: str = Field(
        min_length=1, max_length=200, description="The sandbox id: spreads equally loaded hosts."
    )
    avoid: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Host queues to take only when no other host has room.",
    )


class PlaceResult(_Model):
    host_queue: str | None = Field(None, description="The host to use; None: see `full`.")
    full: bool = Field(
        False,
        description="Hosts publish their load but none has room: wait and ask again. "
        "False with no host_queue: no host publishes its load; use the shared queue.",
    )


class PlaceGroupArgs(_Model):
    keys: list[str] = Field(min_length=1, max_length=256, description="The forks' sandbox ids, in order.")
    avoid: list[str] = Field(default_factory=list, max_length=64, description="As `PlaceArgs.avoid`.")
    changed_host: str | None = Field(
        None,
        description="A host whose load the caller just changed (the group's set-up sandbox removed from it): "
        "placement waits for that host's record written after `changed_at`.",
    )
    changed_at: float | None = Field(None, description="Unix time of that change.")


class PlaceGroupResult(_Model):
    host_queues: list[str | None] = Field(
        description="Per key, the host to fork it on; None: no host has room for it (its member creates a "
        "sandbox of its own, placed when it starts). Empty when no host publishes its load."
    )


class DestroyArgs(_Model):
    handle: SandboxHandle
    delete_checkpoints: bool = Field(False, description="Also delete the lineage's checkpoint objects.")


class DestroyResult(_Model):
    deleted_objects: int = 0


class WorkspaceHashArgs(_Model):
    handle: SandboxHandle
    path: str = "/workspace"


class WorkspaceHashResult(_Model):
    sha256: str


PLACE = Activity("sandbox.place", PlaceArgs, PlaceResult)
PLACE_GROUP = Activity("sandbox.place_group", PlaceGroupArgs, PlaceGroupResult)
CREATE = Activity("sandbox.create", CreateSandboxArgs, CreateSandboxResult)
EXEC = Activity("sandbox.exec", ExecArgs, ExecResult)
CHECKPOINT = Activity("sandbox.checkpoint", CheckpointArgs, CheckpointResult)
CAPTURE_CHECKPOINT = Activity("sandbox.capture_checkpoint", CheckpointArgs, CaptureResult)
PUBLISH_CHECKPOINT = Activity("sandbox.publish_checkpoint", PublishArgs, CheckpointResult)
FORK = Activity("sandbox.fork", ForkArgs, ForkResult)
RECOVER = Activity("sandbox.recover", RecoverArgs, RecoverResult)
DESTROY = Activity("sandbox.destroy", DestroyArgs, DestroyResult)
WORKSPACE_HASH = Activity("sandbox.workspace_hash", WorkspaceHashArgs, WorkspaceHashResult)
VERIFY = Activity("sandbox.verify", VerifyArgs, VerifyResult)
