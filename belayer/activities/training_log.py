"""A training run's iteration log: one JSON record per iteration in the object store.

The workflow keeps only its latest records; `belayer train status` and `--json` read the
whole run from here (`read_iterations`). Records are written create-if-absent at their
iteration's position, so a retried write is a no-op and history is never rewritten.
"""

from __future__ import annotations

import asyncio

from belayer.activities.runtime import implements
from belayer.contracts.training_log import (
    RECORD_ITERATION,
    START_RUN_LOG,
    RecordIterationArgs,
    StartRunLogArgs,
)
from belayer.storage.recordlog import RecordLog, RecordLogRef


def run_log_key(run_id: str) -> str:
    return f"runs/{run_id}/iterations"


def read_iterations(store, log: RecordLogRef) -> list[dict]:
    """Every iteration record of the run, in order."""
    return RecordLog(store, log.key).read(log.length)


class TrainingLogActivities:
    """Served by the workflow worker, beside the context activities (same store)."""

    def __init__(self, store):
        self.store = store

    @implements(START_RUN_LOG)
    async def start_log(self, args: StartRunLogArgs) -> RecordLogRef:
        key = run_log_key(args.run_id)
        await asyncio.to_thread(RecordLog.create, self.store, key)
        return RecordLogRef(key=key, length=0)

    @implements(RECORD_ITERATION)
    async def record_iteration(self, args: RecordIterationArgs) -> None:
        await asyncio.to_thread(RecordLog(self.store, args.log.key).put, args.position, args.record)

    def all(self) -> list:
        return [self.start_log, self.record_iteration]
