"""`trainer.train_step`'s error types and fault points (no servers, no model)."""

from __future__ import annotations

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from belayer.activities import train
from belayer.faults import TRAINER_ENV, Fault
from belayer.storage.errors import CorruptObject, ObjectNotFound
from belayer.trainer.models import TrainStepArgs
from belayer.trainer.step import TrainRequestError

ARGS = TrainStepArgs(run_id="r", iteration=0, model="tiny", samples=[])


class Failing:
    def __init__(self, exc):
        self.exc = exc

    def step(self, store, args, events):
        raise self.exc


@pytest.mark.parametrize(
    "exc, kind, retryable",
    [
        (CorruptObject("bad segment"), "CorruptSample", False),
        (TrainRequestError("iteration 3 needs a base"), "BadTrainRequest", False),
    ],
)
async def test_errors_say_whether_a_retry_can_help(exc, kind, retryable):
    with pytest.raises(ApplicationError) as raised:
        await ActivityEnvironment().run(train.TrainerActivities(Failing(exc), None).train_step, ARGS)
    assert (raised.value.type, raised.value.non_retryable) == (kind, not retryable)


async def test_other_errors_are_left_to_the_retry_policy():
    with pytest.raises(ObjectNotFound):
        await ActivityEnvironment().run(
            train.TrainerActivities(Failing(ObjectNotFound("gone")), None).train_step, ARGS
        )


def test_a_fault_fires_once_per_run_and_only_at_its_iteration(tmp_path, monkeypatch):
    fired = []
    monkeypatch.setattr(train, "die_now", lambda: fired.append(True))
    fault = Fault("crash_after_checkpoint", {"iteration": "2", "dir": str(tmp_path)})
    assert train.fault_hook(fault, "run-a", 1) is None
    hook = train.fault_hook(fault, "run-a", 2)
    hook("stepped")
    assert fired == []
    hook("checkpointed")
    train.fault_hook(fault, "run-a", 2)("checkpointed")  # the restarted worker's retry
    assert fired == [True]
    train.fault_hook(fault, "run-b", 2)("checkpointed")
    assert fired == [True, True]


def test_an_unknown_fault_is_refused(monkeypatch):
    monkeypatch.setenv(TRAINER_ENV, "crash_sometime")
    train.active_fault.cache_clear()
    try:
        with pytest.raises(ValueError, match="unknown trainer fault point"):
            train.active_fault()
    finally:
        train.active_fault.cache_clear()
