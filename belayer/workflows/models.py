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
from belayer.trajectory_log import RecoveryRecord, StepRecord, TrajectoryLogRef  # noqa: F401 (re-exported)
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
    max_recoveries: int = Field(8, ge=0, le=64, description="Sandbox recoveries before giving up as failed_infra.")
    continue_as_new_every: int = Field(
        100, ge=1, description="Steps per workflow run; history restarts after that many."
    )
    carried: TrajectoryState | None = Field(None, description="Set by continue-as-new only.")


class TrajectoryState(_Model):
    """The workflow's whole memory; carried across continue-as-new."""

    step: int = Field(0, description="Steps executed so far: also the index of the next turn.")
    context: PrefixRef | None = None
    node_queue: str | None = Field(None, description="Rollout node that served the last turn.")
    sandbox: SandboxHandle | None = None
    log: TrajectoryLogRef | None = Field(None, description="Steps, decisions and recoveries in the object store.")
    checkpoints: list[CheckpointRef] = Field([], description="Newest first, a few kept.")
    policy: CheckpointPolicy = CheckpointPolicy()
    recoveries: list[RecoveryRecord] = Field(
        [], description="Every recovery so far (also in the log): at most max_recoveries of them."
    )
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
    decisions: int = Field(0, description="Checkpoint decisions so far (one after each action).")
    recent_decisions: list[DecisionRecord] = Field(description="The latest ones; all are in the log.")
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
    context: PrefixRef | None = Field(
        None, description="The whole token log (tokens, model/env marks, logprobs): what a trainer reads."
    )
    env_sha256: str | None
    recoveries: list[RecoveryRecord]
    checkpoints: int
    log: TrajectoryLogRef | None = Field(
        None, description="Steps, every checkpoint decision and recovery, in the object store "
        "(belayer.trajectory_log.read_steps / read_decisions / read_recoveries)."
    )


TrajectoryInput.model_rebuild()
