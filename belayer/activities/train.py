"""`trainer.train_step`: one iteration's policy update, served on the trainer's own queue.

The work runs in a thread while the activity heartbeats every second, so a trainer that
dies is noticed within the heartbeat timeout and the step is retried on the restarted
worker: it resumes from the base checkpoint (or answers "already done" when the dead
attempt had written its checkpoint), and gives the same bytes as an uninterrupted step.

Errors: a sample that does not verify costs its group (left out of the step, recorded in
its `skipped`), not the run; a base checkpoint that does not verify is `CorruptSample`,
arguments the trainer cannot serve are `BadTrainRequest`, both non-retryable; anything
else (storage unreachable, out of memory) is retried.

Its fault points (belayer/faults.py: `crash_before_checkpoint`, `crash_after_checkpoint`,
switched on by `BELAYER_TRAINER_FAULT=name[:key=value[;key=value]]`, read once per
process) SIGKILL the worker at the step's event of that name. `iteration=K` restricts one
to iteration K. A fault fires once per run: it first creates
`<dir>/belayer-trainer-fault-<name>-<run_id>` exclusively (`dir` defaults to the system
temp folder) and fires only if that marker was not there. A marker outlives the process
and does not depend on Temporal's attempt numbering (a retry after a lost heartbeat,
or a second iteration, would otherwise fire again), so a restarted worker with the
same environment goes on without faulting.
"""

from __future__ import annotations

import asyncio
import functools
import os
import tempfile
from pathlib import Path

from pydantic import ValidationError

from belayer.activities.runtime import FailsAs, Failures, heartbeating, implements
from belayer.contracts.errors import BAD_TRAIN_REQUEST, CORRUPT_SAMPLE
from belayer.contracts.trainer import (
    START_WEIGHTS,
    TRAIN_STEP,
    StartWeightsArgs,
    TrainStepArgs,
    TrainStepResult,
)
from belayer.faults import TRAINER_ENV, Fault, die_now, switched_on
from belayer.storage.errors import CorruptObject
from belayer.storage.store import ObjectRef
from belayer.trainer.step import Trainer, TrainRequestError

# The step's event at which each fault point fires.
FAULT_EVENTS = {"crash_before_checkpoint": "stepped", "crash_after_checkpoint": "checkpointed"}
HEARTBEAT_EVERY_S = 1.0
# A sample that does not verify and arguments the trainer cannot serve are final; the rest,
# storage errors included, is retried: a retried step resumes from its base checkpoint.
FAILURES = Failures(
    {
        CorruptObject: FailsAs(CORRUPT_SAMPLE, "a checkpoint does not verify"),
        TrainRequestError: FailsAs(BAD_TRAIN_REQUEST),
        ValidationError: FailsAs(BAD_TRAIN_REQUEST),
    },
    by_retryable=False,
)


class TrainerActivities:
    def __init__(self, trainer: Trainer, store):
        self.trainer, self.store = trainer, store

    @implements(TRAIN_STEP, FAILURES)
    async def train_step(self, args: TrainStepArgs) -> TrainStepResult:
        events = fault_hook(active_fault(), args.run_id, args.iteration)
        return await heartbeating(
            asyncio.to_thread(self.trainer.step, self.store, args, events),
            every_s=HEARTBEAT_EVERY_S,
            details=lambda: {"iteration": args.iteration},
            at_start=True,
        )

    @implements(START_WEIGHTS, FAILURES)
    async def start_weights(self, args: StartWeightsArgs) -> ObjectRef:
        return await heartbeating(asyncio.to_thread(self.trainer.start_weights, self.store, args),
                                  every_s=HEARTBEAT_EVERY_S)  # fmt: skip

    def all(self) -> list:
        return [self.train_step, self.start_weights]


@functools.cache
def active_fault() -> Fault | None:
    """The fault `BELAYER_TRAINER_FAULT` switches on for this process (one at a time), read once."""
    selected = list(switched_on(TRAINER_ENV).values())
    if len(selected) > 1:
        raise ValueError(f"{TRAINER_ENV} switches on one trainer fault point at a time, not {len(selected)}")
    return selected[0] if selected else None


def fault_hook(fault: Fault | None, run_id: str, iteration: int):
    """The step's event callback: SIGKILL at the fault's event, once per run."""
    if fault is None or int(fault.number("iteration", iteration)) != iteration:
        return None

    def on_event(event: str) -> None:
        if event == FAULT_EVENTS[fault.name] and _claim(fault, run_id):
            die_now()

    return on_event


def _claim(fault: Fault, run_id: str) -> bool:
    """True for the first claim of this fault in this run, on this machine."""
    folder = Path(fault.params.get("dir") or tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / f"belayer-trainer-fault-{fault.name}-{run_id}", os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True
