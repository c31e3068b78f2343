"""A training run's iteration log: one JSON record per iteration in the object store, and
the retention of its checkpoints.

The workflow keeps only its latest records; `belayer train status` and `--json` read the
whole run from here (`read_iterations`). Records are written create-if-absent at their
iteration's position, so a retried write is a no-op and history is never rewritten.
"""

from __future__ import annotations

import asyncio

from belayer.activities.runtime import implements
from belayer.contracts.publish import STACK_WEIGHTS_KEY, PublishedWeights
from belayer.contracts.training_log import (
    PRUNE_CHECKPOINT,
    RECORD_ITERATION,
    START_RUN_LOG,
    PruneCheckpointArgs,
    PrunedCheckpoint,
    RecordIterationArgs,
    StartRunLogArgs,
)
from belayer.storage.errors import ObjectNotFound
from belayer.storage.recordlog import RecordLog, RecordLogRef
from belayer.trainer.batch import batch_prefix


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

    @implements(PRUNE_CHECKPOINT)
    async def prune_checkpoint(self, args: PruneCheckpointArgs) -> PrunedCheckpoint:
        return await asyncio.to_thread(prune_checkpoint, self.store, args)

    def all(self) -> list:
        return [self.start_log, self.record_iteration, self.prune_checkpoint]


def prune_checkpoint(store, args: PruneCheckpointArgs) -> PrunedCheckpoint:
    """Delete the trainer checkpoint of `args.iteration` and its weights, as its record names
    them (`delete_step`: unless the stack serves them, which a run's older iterations never
    are, since every node serves the run's latest version before it goes on)."""
    checkpoint = RecordLog(store, args.log.key).get(args.iteration + 1)["checkpoint"]
    deleted, kept = delete_step(store, checkpoint["key"], checkpoint["weights"]["key"])
    if args.run_id is not None:
        deleted += delete_batch(store, args.run_id, args.iteration)
    return PrunedCheckpoint(iteration=args.iteration, deleted=deleted, kept=kept)


def delete_batch(store, run_id: str, iteration: int) -> list[str]:
    """Delete the samples an iteration's train step read (belayer/trainer/batch.py): its
    checkpoint gone, nothing reads them again. The keys deleted."""
    prefix = batch_prefix(run_id, iteration)
    deleted = list(store.list(prefix))
    store.delete_prefix(prefix)
    return deleted


def delete_step(store, checkpoint: str, weights: str | None) -> tuple[list[str], str]:
    """Delete a train step's checkpoint and its weights object (None: not known). The weights
    stay while the stack serves them (a node that restarts loads them). Deleting what is
    gone is no error (a retry). The keys deleted, and why the weights stayed when they did."""
    doomed, kept = [checkpoint], ""
    if weights is not None and weights == stack_weights_key(store):
        kept = "the stack serves these weights"
    elif weights is not None:
        doomed.append(weights)
    deleted = [key for key in doomed if store.exists(key)]
    for key in deleted:
        store.delete(key)
    return deleted, kept


def stack_weights_key(store) -> str | None:
    """The key of the weights the stack's nodes serve (None: none published, or the built model)."""
    try:
        served = PublishedWeights.model_validate_json(store.get_bytes(STACK_WEIGHTS_KEY))
    except ObjectNotFound:
        return None
    return served.weights.key if served.weights is not None else None
