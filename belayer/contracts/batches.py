"""`training.pick_tasks` and `training.store_samples`: a training run's tasks and samples by
reference (belayer/workloads/task_set.py and belayer/trainer/batch.py say why), on the
workflow worker beside the run's record log."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from belayer.contracts.activity import Activity
from belayer.trainer.models import SamplesRef, TrainSample
from belayer.workloads.models import Task
from belayer.workloads.task_set import TaskSetRef

# About 340 KB a part (a sample carries its RolloutRef): far under Temporal's 2 MB, few
# activities per iteration.
SAMPLES_PER_PART = 512


def parts(samples: list[TrainSample]) -> list[list[TrainSample]]:
    """`samples` cut into parts of at most SAMPLES_PER_PART, in order: one STORE_SAMPLES each."""
    return [samples[i : i + SAMPLES_PER_PART] for i in range(0, len(samples), SAMPLES_PER_PART)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PickTasksArgs(_Model):
    task_set: TaskSetRef
    seed: int = Field(ge=0)
    iteration: int = Field(ge=0)
    count: int = Field(ge=1)


class PickedTasks(_Model):
    tasks: list[Task] = Field(description="The iteration's tasks, in the order its groups run.")


class StoreSamplesArgs(_Model):
    run_id: str = Field(min_length=1)
    iteration: int = Field(ge=0)
    samples: list[TrainSample] = Field(description="One part of the batch (at most SAMPLES_PER_PART).")


PICK_TASKS = Activity("training.pick_tasks", PickTasksArgs, PickedTasks)
STORE_SAMPLES = Activity("training.store_samples", StoreSamplesArgs, SamplesRef)
