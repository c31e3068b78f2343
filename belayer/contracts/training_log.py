"""`training.start_log` and `training.record_iteration`: a training run's iteration log in
the object store (belayer/activities/training_log.py says how)."""

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


START_RUN_LOG = Activity("training.start_log", StartRunLogArgs, RecordLogRef)
RECORD_ITERATION = Activity("training.record_iteration", RecordIterationArgs, None)
