"""Input, state, progress and result of a training run: the public API of `TrainingWorkflow`.

Small and serialisable like the trajectory's models: tasks, pointers and hashes. Every
iteration's record goes to a record log in the object store (`runs/<run>/iterations`);
the workflow keeps only the latest few, so its state stays the same size over
thousands of iterations.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from belayer.contracts.trainer import SkippedGroup, TrainerCheckpointRef, TrainerSettings
from belayer.policy.config import PolicyConfig
from belayer.storage.recordlog import RecordLogRef
from belayer.workflows.models import GroupRecord
from belayer.workflows.rollout_models import RolloutQueues, RolloutSettings
from belayer.workloads.models import Task
from belayer.workloads.task_set import TaskSetRef

TrainingStatus = Literal["running", "completed", "failed_infra"]
Phase = Literal["starting", "rollout", "train", "publish", "done"]
RECENT_RECORDS = 5
# With reuse_setup a run keeps a set-up checkpoint per task it has drawn, in its state (so
# through every continue-as-new) and on the sandbox hosts' disks, until it ends:
# `belayer.training.training_input` turns it off above this many tasks, and refuses it asked for.
MAX_REUSED_SETUPS = 256


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainingQueues(RolloutQueues):
    """Where the run sends its work: a batch's queues, and the trainer's."""

    trainer: str = Field("belayer-trainer", description="Queue of the trainer worker.")


class TrainingInput(_Model):
    """What a client passes to `TrainingWorkflow` (`belayer.training.training_input` fills it)."""

    run_id: str = Field(min_length=1, max_length=80, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    tasks: list[Task] = Field(
        default_factory=list,
        description="The tasks iterations draw from, inline: a small set, or a run from before `task_set`.",
    )
    task_set: TaskSetRef | None = Field(
        None,
        description="The tasks iterations draw from, stored (belayer/workloads/task_set.py): "
        "`belayer.training.start_training` stores them, so a dataset of any size starts.",
    )
    heldout: list[Task] = Field(
        default_factory=list,
        description="Evaluated once per iteration (one trajectory each, never trained on).",
    )
    model: str = Field(description="The project-built model the engines serve and the trainer starts from.")
    iterations: int = Field(ge=1, le=1_000_000)
    group_size: int = Field(ge=2, le=256, description="Trajectories per task per iteration (a GRPO group).")
    tasks_per_iteration: int = Field(ge=1, le=4096)
    seed: int = Field(0, ge=0, lt=2**31)
    temperature: float = Field(1.0, gt=0, le=5, description="Sampling temperature of the rollouts.")
    trainer: TrainerSettings = TrainerSettings()
    policy: PolicyConfig = PolicyConfig()
    max_total_tokens: int = Field(2048, ge=1)
    max_recoveries: int = Field(
        8,
        ge=0,
        le=64,
        description="Sandbox recoveries per trajectory (0: a lost sandbox ends it failed_infra, "
        "and the member restarts from its first turn: what a loop without environment fault tolerance does).",
    )
    max_infra_retries: int = Field(
        2,
        ge=0,
        le=16,
        description="Fresh trajectories (same seed) after a member ends failed_infra; "
        "a group still incomplete after them is dropped whole.",
    )
    concurrency: int = Field(8, ge=1, le=4096, description="Trajectories running at once.")
    fork_groups: bool = Field(
        True,
        description="Fork each group's sandboxes from one set-up sandbox (belayer/workflows/groups.py); "
        "off: every member creates and sets up its own.",
    )
    reuse_setup: bool = Field(
        True,
        description="With fork_groups: later iterations fork a task's set-up checkpoint again instead of "
        "running its setup anew (its members then start from the very same state every iteration).",
    )
    skip_uniform_groups: bool = Field(
        False,
        description="Leave out of the step every group whose members all scored the same (DAPO's dynamic "
        "sampling): such a group has no advantage to teach, yet its tokens count in the loss's mean.",
    )
    keep_last: int | None = Field(
        None,
        ge=1,
        description="Keep the trainer checkpoints (and their weights) of the last N iterations, and "
        "every `keep_every`-th; delete the others as the run goes (None: keep every one).",
    )
    keep_every: int | None = Field(
        None, ge=1, description="With keep_last: also keep iteration K-1, 2K-1, ... (every K-th)."
    )
    queues: TrainingQueues
    continue_as_new_every: int = Field(10, ge=1, description="Iterations per workflow run.")
    carried: TrainingState | None = Field(None, description="Set by continue-as-new only.")

    def rollout_settings(self) -> RolloutSettings:
        """How each iteration's trajectories run (belayer/workflows/rollouts.py)."""
        return RolloutSettings(**self.model_dump(include=set(RolloutSettings.model_fields)))

    @model_validator(mode="after")
    def _one_temperature(self) -> TrainingInput:
        """The trainer takes logprobs under the temperature the rollouts sampled at: at
        another, every ratio it clips against would be off from the first minibatch on,
        and nothing would say so."""
        if self.trainer.temperature != self.temperature:
            raise ValueError(
                f"the rollouts sample at temperature {self.temperature:g} but the trainer takes logprobs at "
                f"trainer.temperature {self.trainer.temperature:g}: give both the same value "
                "(`belayer train --temperature` sets both)"
            )
        return self

    @model_validator(mode="after")
    def _retention(self) -> TrainingInput:
        if self.keep_every is not None and self.keep_last is None:
            raise ValueError(
                "keep_every without keep_last keeps every checkpoint anyway: give keep_last too "
                "(`belayer train --keep-last N --keep-every K`)"
            )
        return self

    def kept(self, iteration: int) -> bool:
        """Whether iteration `iteration`'s checkpoint is kept once it is `keep_last` behind."""
        return self.keep_every is not None and (iteration + 1) % self.keep_every == 0

    @property
    def task_count(self) -> int:
        return self.task_set.count if self.task_set is not None else len(self.tasks)

    @model_validator(mode="after")
    def _enough_tasks(self) -> TrainingInput:
        if bool(self.tasks) == (self.task_set is not None):
            raise ValueError(
                "give the run's tasks either inline (tasks) or stored (task_set), not both or neither"
            )
        if self.tasks_per_iteration > self.task_count:
            raise ValueError(
                f"tasks_per_iteration is {self.tasks_per_iteration} but the workload has {self.task_count} "
                "tasks; lower it or add tasks"
            )
        return self


class IterationRecord(_Model):
    """What one iteration did; one record per iteration in the run's record log."""

    iteration: int
    tasks: list[str]
    rewards: list[list[float | None]] = Field(description="Per group (task order), per member: the rewards.")
    actions: list[list[int | None]] = Field(
        default_factory=list,
        description="Per group (task order), per member: the actions its trajectory ran in its sandbox "
        "(None when it failed on infrastructure; empty in a record from before they were kept).",
    )
    mean_reward: float | None = Field(description="Over the kept groups' members.")
    heldout_reward: float | None = None
    groups_kept: int
    groups_dropped: int
    uniform_groups: int = Field(
        0,
        description="Complete groups whose members all scored the same (no advantage), "
        "whether or not skip_uniform_groups left them out.",
    )
    dropped: list[SkippedGroup] = Field(default_factory=list, description="Why each dropped group went.")
    infra_retries: int
    weights_version: int
    weights_sha256: str
    checkpoint: TrainerCheckpointRef
    loss: float
    kl: float
    clip_fraction: float
    trained_tokens: int
    engine_logprob_drift: float | None = Field(
        None,
        description="Largest |engine logprob - trainer logprob| over the trained tokens: how far the "
        "engines' numbers are from the trainer's (None: no token trained, or a record from before it was kept).",
    )
    entropy: float | None = Field(
        None, description="The sampling policy's mean entropy over the trained tokens (None: none trained)."
    )
    grad_norm: float | None = Field(None, description="Mean gradient norm before clipping, per minibatch.")
    lr: float | None = Field(None, description="The step's learning rate, after decay.")
    response_tokens: float | None = Field(None, description="Model-generated tokens per trained trajectory.")
    trainer_resumed_from: str
    rollout_s: float
    train_s: float
    publish_s: float
    recovery_s: float = Field(
        0.0,
        description="Time recoveries lost, summed over the iteration's trajectories "
        "(they run side by side, so it can exceed rollout_s).",
    )
    elapsed_s: float = Field(
        0.0, description="Seconds from the run's start to this record (the curve's x axis)."
    )
    tokens_after_recovery: int = Field(
        0,
        ge=0,
        description="Tokens the iteration's trajectories generated after an engine recovery interrupted a "
        "turn: the ones equal to an uninterrupted run's with high probability, not surely.",
    )
    recovered_tokens_differ: list[str] = Field(
        default_factory=list,
        description="Trajectories flagged: a recovered turn, replayed uninterrupted, drew other tokens.",
    )
    group_sandboxes: list[GroupRecord] = Field(
        default_factory=list,
        description="How each group's members got their sandboxes (forks of one set-up "
        "sandbox, or their own) and what it took.",
    )

    def for_state(self) -> IterationRecord:
        """The record as the workflow's state keeps it (`TrainingState.recent`): without
        each group's sandboxes, which the record log has, so the state carried through
        continue-as-new stays far under Temporal's 2 MB at thousands of groups."""
        return self.model_copy(update={"group_sandboxes": []})


class TrainingState(_Model):
    """The run's whole memory; carried across continue-as-new."""

    iteration: int = Field(0, description="The next iteration to run.")
    checkpoint: TrainerCheckpointRef | None = Field(
        None, description="The latest trainer state (None: built model)."
    )
    serving_version: int = Field(1, description="The weights version every node serves now.")
    log: RecordLogRef | None = None
    recent: list[IterationRecord] = Field(
        default_factory=list,
        description=f"The last {RECENT_RECORDS} records, without `group_sandboxes` (the record log has them).",
    )
    runs: int = 1
    started_at: datetime | None = Field(
        None, description="When the run's first iteration began (workflow time)."
    )
    origins: dict[str, GroupRecord] = Field(
        default_factory=dict,
        description="Per task, the group whose set-up checkpoint later groups fork "
        "(`reuse_setup`); deleted when the run ends.",
    )
    resumed: int = Field(
        0,
        ge=0,
        description="How many times `belayer train resume` continued the run. Its trajectory ids carry "
        "it: an iteration the run had begun runs again as new trajectories, not over the old ones' logs.",
    )
    publish_checkpoint: bool = Field(
        False,
        description="Set by a resume: the nodes serve `checkpoint`'s weights again (as a new version) "
        "before the next iteration samples.",
    )


class TrainingProgress(_Model):
    """What the `progress` query answers."""

    run_id: str
    status: TrainingStatus
    iteration: int
    iterations: int
    phase: Phase
    members_done: int
    members_total: int
    running: list[str] = Field(default_factory=list, description="Trajectories in flight now.")
    serving_version: int
    recent: list[IterationRecord]
    log: RecordLogRef | None


class TrainingResult(_Model):
    run_id: str
    status: TrainingStatus
    reason: str = ""
    iterations_done: int
    final_weights_sha256: str | None
    checkpoint: TrainerCheckpointRef | None
    log: RecordLogRef | None = Field(
        description="Every iteration's record (`belayer.training.read_iterations`)."
    )


TrainingInput.model_rebuild()
