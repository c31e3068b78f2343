"""A training run's iteration log: one JSON record per iteration in the object store.

The workflow keeps only its latest records; `belayer train status` and `--json` read the
whole run from here (`read_iterations`). Records are written create-if-absent at their
iteration's position, so a retried write is a no-op and history is never rewritten.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field
from temporalio import activity

from belayer.storage.recordlog import RecordLog, RecordLogRef


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StartRunLogArgs(_Model):
    run_id: str = Field(min_length=1)


class RecordIterationArgs(_Model):
    log: RecordLogRef
    position: int = Field(ge=1, description="Iteration + 1 (record logs count from 1).")
    record: dict = Field(description="An `IterationRecord`, as JSON.")


def run_log_key(run_id: str) -> str:
    return f"runs/{run_id}/iterations"


def read_iterations(store, log: RecordLogRef) -> list[dict]:
    """Every iteration record of the run, in order."""
    return RecordLog(store, log.key).read(log.length)


class TrainingLogActivities:
    """Served by the workflow worker, beside the context activities (same store)."""

    def __init__(self, store):
        self.store = store

    @activity.defn(name="training.start_log")
    async def start_log(self, args: StartRunLogArgs) -> RecordLogRef:
        key = run_log_key(args.run_id)
        await asyncio.to_thread(RecordLog.create, self.store, key)
        return RecordLogRef(key=key, length=0)

    @activity.defn(name="training.record_iteration")
    async def record_iteration(self, args: RecordIterationArgs) -> None:
        await asyncio.to_thread(RecordLog(self.store, args.log.key).put, args.position, args.record)

    def all(self) -> list:
        return [self.start_log, self.record_iteration]
