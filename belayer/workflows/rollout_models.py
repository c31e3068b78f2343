"""The models of a batch of rollouts: what a training iteration and a `RolloutClient`
batch both run (belayer/workflows/rollouts.py), and what each member ended as.

One data model for both: `RolloutSettings` says how every trajectory of a batch runs,
`RolloutRef` (belayer/trainer/models.py) is one group member after Belayer's own retries
(pointers and hashes; the tokens stay in the object store, and Belayer's trainer and the
rollout API read them as the same `Rollout`), `GroupOutcome` is one task's group.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from belayer.contracts.trainer import RolloutRef
from belayer.policy.config import PolicyConfig
from belayer.workflows.models import GroupRecord, TaskQueues
from belayer.workloads.models import Task


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutQueues(_Model):
    """Where a batch sends its work besides the trajectories' own queues."""

    trajectories: TaskQueues = TaskQueues()
    workflows: str = Field("belayer-workflows", description="Queue of the child trajectory workflows.")
    nodes: list[str] = Field(
        min_length=1,
        description="Every rollout node's own queue: each new weights version is published to all.",
    )


class RolloutSettings(_Model):
    """How every trajectory of a batch runs: the same for a training run's iterations and a
    `RolloutClient` batch, so both give the same members the same seeds and retries."""

    group_size: int = Field(ge=1, le=256, description="Trajectories per task (a GRPO group).")
    seed: int = Field(0, ge=0, lt=2**31)
    temperature: float = Field(1.0, gt=0, le=5, description="Sampling temperature of the rollouts.")
    policy: PolicyConfig = PolicyConfig()
    max_total_tokens: int = Field(2048, ge=1)
    max_recoveries: int = Field(8, ge=0, le=64, description="Sandbox recoveries per trajectory.")
    max_infra_retries: int = Field(
        2,
        ge=0,
        le=16,
        description="Fresh trajectories (same seed) after a member ends failed_infra.",
    )
    concurrency: int = Field(8, ge=1, le=4096, description="Trajectories running at once.")
    fork_groups: bool = Field(True, description="Fork each group's sandboxes from one set-up sandbox.")
    reuse_setup: bool = Field(
        True, description="With fork_groups: later groups of a task fork its set-up checkpoint again."
    )


class GroupOutcome(_Model):
    """One task's group: its members in order, and how they got their sandboxes."""

    task: str
    members: list[RolloutRef]
    sandboxes: GroupRecord | None = Field(None, description="None when the group was not forked.")


class RolloutRequest(_Model):
    """What a client passes to `RolloutWorkflow` (`belayer.rollouts.RolloutClient` fills it)."""

    batch_id: str = Field(min_length=1, max_length=80, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    tasks: list[Task] = Field(min_length=1, max_length=4096)
    settings: RolloutSettings
    queues: RolloutQueues
    weights_version: int | None = Field(
        None,
        ge=1,
        description="The version every node must serve when the batch starts (None: whatever they serve).",
    )

    @model_validator(mode="after")
    def _one_group_per_task(self) -> RolloutRequest:
        """A task's group is named after its id (so are its trajectories' workflows)."""
        ids = [t.id for t in self.tasks]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"task ids repeat ({', '.join(repeated)}); give each task of a batch its own id")
        return self


class RolloutProgress(_Model):
    """What `RolloutWorkflow`'s `progress` query answers: every member done so far, in the
    order they ended (a client streams them from it)."""

    batch_id: str
    members_total: int
    finished: list[RolloutRef]
    running: list[str] = Field(default_factory=list, description="Trajectories in flight now.")


class RolloutResult(_Model):
    batch_id: str
    groups: list[GroupOutcome]


class NestedGroupInput(_Model):
    """One group of a large batch, run as a child workflow of its own (`NestedGroupWorkflow`)."""

    run_id: str = Field(description="The run or batch the group belongs to (its trajectories carry it).")
    resumed: int = Field(0, ge=0, description="How many times the run was resumed (its ids say so).")
    iteration: int = Field(ge=0)
    task: Task
    settings: RolloutSettings = Field(
        description="The batch's, with `concurrency` the slots the group holds."
    )
    queues: RolloutQueues
    origin: GroupRecord | None = Field(
        None, description="The task's set-up checkpoint kept from an earlier group."
    )


class NestedGroupResult(_Model):
    members: list[RolloutRef]
    records: list[GroupRecord] = Field(description="How the group got its sandboxes.")
    origin: GroupRecord | None = Field(
        None, description="The set-up checkpoint later groups of the task fork."
    )
