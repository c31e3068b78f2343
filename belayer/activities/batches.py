"""A training run's tasks drawn from its stored task set, and its samples stored in parts
(belayer/contracts/batches.py): what keeps an iteration's payloads small whatever the
dataset's and the batch's size."""

from __future__ import annotations

import asyncio

from belayer.activities.runtime import implements
from belayer.contracts.batches import PICK_TASKS, STORE_SAMPLES, PickedTasks, PickTasksArgs, StoreSamplesArgs
from belayer.trainer.batch import store_samples
from belayer.trainer.models import SamplesRef
from belayer.workloads.task_set import load_task_set, pick


class BatchActivities:
    """Served by the workflow worker, beside the record log (same store)."""

    def __init__(self, store):
        self.store = store

    @implements(PICK_TASKS)
    async def pick_tasks(self, args: PickTasksArgs) -> PickedTasks:
        tasks = await asyncio.to_thread(load_task_set, self.store, args.task_set)
        return PickedTasks(tasks=pick(tasks, args.seed, args.iteration, args.count))

    @implements(STORE_SAMPLES)
    async def store_samples(self, args: StoreSamplesArgs) -> SamplesRef:
        return await asyncio.to_thread(store_samples, self.store, args.run_id, args.iteration, args.samples)

    def all(self) -> list:
        return [self.pick_tasks, self.store_samples]
