"""Input, state, progress and result of a trajectory: the public API of the workflow.

Everything here is small and serialisable: pointers (S3 keys, token-log refs) and
hashes, never token arrays or archives, so histories stay far under Temporal's limits.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from belayer.policy.adaptive import CheckpointPolicy, DecisionRecord
from belayer.policy.config import PolicyConfig
from belayer.sandbox.models import CheckpointRef, SandboxHandle
from belayer.storage.tokenlog import PrefixRef
from belayer.workloads.models import Task

TrajectoryStatus = Literal["running", "completed", "failed_policy", "failed_infra"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Sampling(_Model):
    """How the engine samples; seeded, so a replay draws the same tokens."""

    temperature: float = Field(0.0, ge=0, le=5)
    seed: int = Field(0, ge=0)


class TaskQueues(_Model):
    """Where each kind of activity is sent."""

    rollout: str = Field("belayer-rollout", description="Shared queue of every rollout node.")
    sandbox: str = Field("belayer-sandbox", description="Shared queue of every sandbox host (create, recover).")
    context: str = Field("belayer-workflows", description="Queue of the context (tokenizer) activities.")


class TrajectoryInput(_Model):
    """What a client passes to `TrajectoryWorkflow`."""

    trajectory_id: str = Field(min_length=1, max_length=180)
    task: Task
    sampling: Sampling = Sampling()
    policy: PolicyConfig = PolicyConfig()
    queues: TaskQueues = TaskQueues()
    max_total_tokens: int = Field(32768, ge=1, description="Token budget of the whole context.")
    max_recoveries: int = Field(8, ge=0, description="Sandbox recoveries before giving up as failed_infra.")
    continue_as_new_every: int = Field(
        100, ge=1, description="Steps per workflow run; history restarts after that many."
    )
    carried: TrajectoryState | None = Field(None, description="Set by continue-as-new only.")


class StepRecord(_Model):
    """One executed step, as the context saw it."""

    step: int = Field(ge=1)
    command: str
    observation_sha256: str
    exit_code: int
    context_after_action: PrefixRef = Field(description="Context up to and including this action.")


class RecoveryRecord(_Model):
    """One recovery: what failed, how it came back, what it cost."""

    kind: Literal["sandbox"]
    step: int = Field(description="Step whose action was in flight when the failure surfaced.")
    reason: str
    source: str = Field(description="Checkpoint step restored, replay from the start, or 'failed'.")
    failed: bool = Field(False, description="The recover itself failed (its new sandbox was lost too, or "
                         "nothing could be restored); `notes` says why.")
    replayed_steps: int
    consistent: bool
    notes: list[str] = Field([], description="Checkpoints skipped as unusable and fallbacks taken, and why.")
    cut_after_step: int | None = Field(None, description="Context cut after this action (mismatch).")
    tokens_discarded: int = 0
    time_lost_s: float


class TrajectoryState(_Model):
    """The workflow's whole memory; carried across continue-as-new."""

    step: int = Field(0, description="Steps executed so far: also the index of the next turn.")
    context: PrefixRef | None = None
    node_queue: str | None = Field(None, description="Rollout node that served the last turn.")
    sandbox: SandboxHandle | None = None
    steps: list[StepRecord] = []
    checkpoints: list[CheckpointRef] = Field([], description="Newest first, a few kept.")
    policy: CheckpointPolicy = CheckpointPolicy()
    recoveries: list[RecoveryRecord] = []
    generations: int = 0
    stopped: bool = False
    log_generation: int = Field(0, description="Bumped on each context cut (a forked token log).")
    runs: int = Field(1, description="Workflow runs so far (continue-as-new).")


class TrajectoryProgress(_Model):
    """What the `progress` query answers about a running trajectory."""

    trajectory_id: str
    task: str
    status: TrajectoryStatus
    step: int
    tokens: int
    checkpoints_taken: int
    latest_checkpoint_step: int | None
    recoveries: list[RecoveryRecord]
    recent_decisions: list[DecisionRecord]
    predictor_error: dict[str, float | None]
    sandbox: SandboxHandle | None


class TrajectoryResult(_Model):
    """How a trajectory ended. An infrastructure failure is never a zero reward."""

    trajectory_id: str
    task: str
    status: TrajectoryStatus
    reason: str = ""
    turns: int
    tokens: int
    reward: float | None = Field(description="1 or 0 from the task's check; None when failed_infra.")
    token_sha256: str | None
    env_sha256: str | None
    recoveries: list[RecoveryRecord]
    checkpoints: int
    decisions: list[DecisionRecord]


TrajectoryInput.model_rebuild()
