"""`trainer.train_step`: one GRPO iteration on the trainer's queue. Its argument and
result are the trainer's own models (belayer/trainer/models.py, which the trainer steps
with), re-exported here for workflows."""

from __future__ import annotations

from belayer.contracts.activity import Activity
from belayer.trainer.models import (
    SkippedGroup,
    TrainerCheckpointRef,
    TrainerSettings,
    TrainSample,
    TrainStepArgs,
    TrainStepResult,
)

__all__ = [
    "TRAIN_STEP",
    "SkippedGroup",
    "TrainSample",
    "TrainStepArgs",
    "TrainStepResult",
    "TrainerCheckpointRef",
    "TrainerSettings",
]

TRAIN_STEP = Activity("trainer.train_step", TrainStepArgs, TrainStepResult)
