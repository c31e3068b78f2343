"""Input, state, progress and result of a trajectory: the public API of the workflow.

Everything here is small and serialisable: pointers (S3 keys, token-log refs) and
hashes, never token arrays or archives, so histories stay far under Temporal's limits.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from belayer.contracts.generate import RecoveryReplay
from belayer.contracts.sandbox import CheckpointRef, ObservationRef, SandboxHandle, VerifyResult
from belayer.policy.adaptive import CheckpointPolicy, DecisionRecord
from belayer.policy.config import PolicyConfig
from belayer.storage.recordlog import RecordLogRef
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
    sandbox: str = Field(
        "belayer-sandbox", description="Shared queue of every sandbox host (create, recover)."
    )
    context: str = Field("belayer-workflows", description="Queue of the context (tokenizer) activities.")
    context_local: bool = Field(
        True,
        description="Run the context activities as local activities of the workflow's own worker (it "
        "must register them, as Belayer's trajectory worker does): a round trip less per turn. False sends "
        "them to `context`.",
    )


class ForkStart(_Model):
    """How a forked trajectory starts: a member of a group (its sandbox forked from the
    group's set-up sandbox, its context the group's prompt) or a branch of another
    trajectory after its step K (the sandbox restored from the latest checkpoint at or
    before K plus replay-verify up to K, the context the parent had after step K).
    Pointers and hashes only; belayer/workflows/groups.py and `belayer fork` fill it."""

    parent: str = Field(min_length=1, description="The group's id, or the trajectory this one branches from.")
    sandbox: SandboxHandle | None = Field(None, description="A fork started for this trajectory, if one is.")
    checkpoints: list[CheckpointRef] = Field(
        [],
        description="Newest first: restored as a fork of this trajectory when its sandbox is lost (a "
        "member: its group's set-up checkpoint) or was never started (a branch: the parent's, at or before K).",
    )
    prompt: PrefixRef | None = Field(
        None, description="A member: the group's prompt, whose token log it forks."
    )
    at_step: StepRecord | None = Field(
        None, description="A branch: the parent's step K, the last one it keeps."
    )
    steps: RecordLogRef | None = Field(
        None, description="A branch: the parent's step log (steps 1..K-1 inherited)."
    )
    stage_checks: list[VerifyResult] = Field(
        [],
        description="A branch after K within a multi-step task's later stage: the parent's checks of the "
        "stages before it, in order (the stage the branch continues is the next one).",
    )
    stage_start: int = Field(
        0, ge=0, description="A branch: the boundary step its stage began at (no recovery goes behind it)."
    )

    @model_validator(mode="after")
    def _member_or_branch(self) -> ForkStart:
        if (self.prompt is None) == (self.at_step is None):
            raise ValueError(
                "a fork starts from a group's prompt or from a parent's step (at_step), one of them"
            )
        if self.at_step is not None and self.steps is None:
            raise ValueError("a branch needs the parent's step log (steps)")
        if self.stage_checks and self.at_step is None:
            raise ValueError("only a branch continues a later stage (stage_checks)")
        if self.at_step is not None and (self.at_step.stage, self.stage_start > 0) != (
            len(self.stage_checks),
            bool(self.stage_checks),
        ):
            raise ValueError(
                f"a branch at step {self.at_step.step} (stage {self.at_step.stage}) needs the checks of the "
                f"{self.at_step.stage} stage(s) before it and the step its stage began at"
            )
        return self


class GroupRecord(_Model):
    """How a group's members got their sandboxes (belayer/workflows/groups.py), and what it took."""

    group: str
    task: str
    size: int
    forked: int = Field(0, description="Members that start from a fork of the set-up sandbox.")
    fork_hosts: dict[str, int] = Field(
        default_factory=dict, description="How many of the forks each sandbox host started (by its queue)."
    )
    fallback: str = Field("", description="Why members create their own sandboxes, when they do.")
    notes: list[str] = Field([], description="Forks that failed, and why.")
    setup_s: float = Field(0.0, description="Create and set up the one sandbox.")
    checkpoint_s: float = Field(0.0, description="Checkpoint it (the origin).")
    fork_s: float = Field(0.0, description="Start every fork from the origin.")
    ready_s: float = Field(
        0.0,
        description="From the group's start until every member's sandbox was ready "
        "(members that fell back create theirs later).",
    )
    reused_from: str | None = Field(
        None,
        description="The earlier group whose set-up checkpoint was forked (the setup did not run again).",
    )
    origin: CheckpointRef | None = None
    setup_sandbox: SandboxHandle | None = None


class TrajectoryInput(_Model):
    """What a client passes to `TrajectoryWorkflow`."""

    trajectory_id: str = Field(min_length=1, max_length=180)
    task: Task
    sampling: Sampling = Sampling()
    policy: PolicyConfig = PolicyConfig()
    queues: TaskQueues = TaskQueues()
    max_total_tokens: int = Field(32768, ge=1, description="Token budget of the whole context.")
    max_recoveries: int = Field(
        8, ge=0, le=64, description="Sandbox recoveries before giving up as failed_infra."
    )
    continue_as_new_every: int = Field(
        100, ge=1, description="Steps per workflow run; history restarts after that many."
    )
    start_from: ForkStart | None = Field(None, description="Start as a fork: a group member, or a branch.")
    keep_checkpoints: bool = Field(
        False,
        description="Keep the checkpoint objects when the trajectory ends, to branch from them later "
        "(`belayer fork`); the bucket's lifecycle rule expires them.",
    )
    carried: TrajectoryState | None = Field(None, description="Set by continue-as-new only.")


class RecoveredTurn(_Model):
    """A turn an engine recovery interrupted, and what its replay said."""

    turn: int = Field(ge=1, description="The turn (1 is the first).")
    replay: RecoveryReplay


class TrajectoryState(_Model):
    """The workflow's whole memory; carried across continue-as-new."""

    step: int = Field(0, description="Steps executed so far: also the index of the next turn.")
    context: PrefixRef | None = None
    node_queue: str | None = Field(None, description="Rollout node that served the last turn.")
    sandbox: SandboxHandle | None = None
    log: TrajectoryLogRef | None = Field(
        None, description="Steps, decisions and recoveries in the object store."
    )
    checkpoints: list[CheckpointRef] = Field([], description="Newest first, a few kept.")
    policy: CheckpointPolicy = CheckpointPolicy()
    recoveries: list[RecoveryRecord] = Field(
        [], description="Every recovery so far (also in the log): at most max_recoveries of them."
    )
    generations: int = 0
    stopped: bool = False
    log_generation: int = Field(0, description="Bumped on each context cut (a forked token log).")
    runs: int = Field(1, description="Workflow runs so far (continue-as-new).")
    sandbox_pending: str | None = Field(
        None, description="Why the sandbox must be restored before the next turn (a branch's start)."
    )
    unexplained_loss_step: int | None = Field(
        None,
        description="The step during which the sandbox was last lost with no cause found, until a "
        "sandbox call succeeds: losing it there again after the restore is the agent's doing.",
    )
    stage: int = Field(0, description="A multi-step task's stage (Harbor's [[steps]] entry) now running.")
    stage_start: int = Field(
        0, description="The step the stage began after (its boundary: no recovery goes behind it)."
    )
    stage_checks: list[VerifyResult] = Field(
        [], description="The checks of the stages that ended before this one, in order."
    )
    stopped_early: bool = Field(
        False, description="A stage scored below its minimum: no stage after it runs."
    )
    recovered_turns: list[RecoveredTurn] = Field(
        [], description="Each turn an engine recovery interrupted, with its replay's verdict."
    )
    tokens_after_recovery: int = Field(
        0, ge=0, description="Tokens generated since the first engine recovery (see TrajectoryResult)."
    )


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
    node_queue: str | None = Field(
        None, description="The rollout node that served the latest turn (its queue)."
    )


class SandboxBreak(_Model):
    """The agent's own actions brought its sandbox down: the policy's failure (reward 0),
    never recovered nor retried into another verdict."""

    step: int = Field(
        ge=0, description="The step whose action (or check) was running when the sandbox was lost."
    )
    cause: Literal["oom", "pid1-exited", "reproduced"] = Field(
        description="oom: the OOM killer of the sandbox's own memory limit killed PID 1; pid1-exited: PID 1 "
        "ended by itself, nothing outside stopped it; reproduced: no cause was found, and the same action "
        "lost the sandbox again after a restore.",
    )
    detail: str = Field(max_length=4000, description="The host's account of the loss.")


class TrajectoryResult(_Model):
    """How a trajectory ended. An infrastructure failure is never a zero reward; a sandbox
    the agent broke is a zero (failed_policy, `sandbox_broken` says how)."""

    trajectory_id: str
    task: str
    status: TrajectoryStatus
    reason: str = ""
    turns: int
    tokens: int
    reward: float | None = Field(
        description="1 or 0 from the task's check, any value from a graded one; None when failed_infra."
    )
    token_sha256: str | None
    context: PrefixRef | None = Field(
        None, description="The whole token log (tokens, model/env marks, logprobs): what a trainer reads."
    )
    env_sha256: str | None
    recoveries: list[RecoveryRecord]
    checkpoints: int
    log: TrajectoryLogRef | None = Field(
        None,
        description="Steps, every checkpoint decision and recovery, in the object store "
        "(belayer.trajectory_log.read_steps / read_decisions / read_recoveries).",
    )
    rewards: dict[str, float] = Field(
        default_factory=dict, description="Every value a graded check (a Harbor task's tests) wrote."
    )
    verifier_logs: dict[str, str] = Field(
        default_factory=dict, description="A graded check's logs directory: file name -> object key."
    )
    artifacts: dict[str, str] = Field(
        default_factory=dict,
        description="A Harbor task's artifacts read back after its checks: path -> object key.",
    )
    verifier_observation: ObservationRef | None = Field(
        None, description="A graded check's stdout and stderr, stored (belayer inspect shows them)."
    )
    notes: list[str] = Field(
        default_factory=list,
        description="What the task warned of as it ran (e.g. run offline though it asks for network).",
    )
    disk_bytes: int | None = Field(
        None,
        description="A graded check's: what the sandbox had written over its image by then (storage use).",
    )
    sandbox_broken: SandboxBreak | None = Field(
        None, description="failed_policy because the agent broke its own sandbox: at which step, and how."
    )
    tokens_after_recovery: int = Field(
        0,
        ge=0,
        description="Tokens generated after an engine recovery interrupted a turn (that turn's rest and "
        "every later turn): the ones that equal an uninterrupted run's with high probability, not surely.",
    )
    recovered_turns: list[RecoveredTurn] = Field(
        default_factory=list,
        description="Each turn an engine recovery interrupted, replayed from its start on the same engine.",
    )

    @property
    def recovered_tokens_differ(self) -> bool:
        """The flag: a recovered turn's replay drew other tokens than the ones the trajectory
        kept (a near-tie flipped); its reward is still the reward of what its sandbox ran."""
        return any(turn.replay.outcome == "differs" for turn in self.recovered_turns)


TrajectoryInput.model_rebuild()
