"""`training.start_log`, `training.record_iteration` and `training.prune_checkpoint`: a
training run's iteration log in the object store, and the checkpoints its retention lets go
(belayer/activities/training_log.py says how)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from belayer.contracts.activity import Activity
from belayer.storage.recordlog import RecordLogRef


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartRunLogArgs(_Model):
    run_id: str = Field(min_length=1)


class RecordIterationArgs(_Model):
    log: RecordLogRef
    position: int = Field(ge=1, description="Iteration + 1 (record logs count from 1).")
    record: dict = Field(description="An `IterationRecord`, as JSON.")


class PruneCheckpointArgs(_Model):
    log: RecordLogRef = Field(description="The run's log, holding the record of `iteration`.")
    iteration: int = Field(ge=0, description="The iteration whose trainer checkpoint and weights go.")
    run_id: str | None = Field(None, description="The run's id: the iteration's stored samples go too.")


class PrunedCheckpoint(_Model):
    iteration: int
    deleted: list[str] = Field(description="The keys deleted (none when an earlier attempt deleted them).")
    kept: str = Field("", description="Why the weights stayed, when they did.")


START_RUN_LOG = Activity("training.start_log", StartRunLogArgs, RecordLogRef)
RECORD_ITERATION = Activity("training.record_iteration", RecordIterationArgs, None)
PRUNE_CHECKPOINT = Activity("training.prune_checkpoint", PruneCheckpointArgs, PrunedCheckpoint)
