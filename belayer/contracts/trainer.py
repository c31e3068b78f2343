"""`trainer.train_step`: one iteration's policy update on the trainer's queue. Its argument
and result are the trainer's own models (belayer/trainer/models.py, which the trainer
steps with), re-exported here for workflows, with the algorithms by name: the workflow
computes a group's advantages with the run's algorithm, the trainer takes its loss."""

from __future__ import annotations

from belayer.contracts.activity import Activity
from belayer.storage.store import ObjectRef
from belayer.trainer.algorithms import Algorithm, algorithm
from belayer.trainer.models import (
    RolloutRef,
    SkippedGroup,
    StartWeightsArgs,
    TrainerCheckpointRef,
    TrainerSettings,
    TrainSample,
    TrainStepArgs,
    TrainStepResult,
)

__all__ = [
    "START_WEIGHTS",
    "TRAIN_STEP",
    "StartWeightsArgs",
    "Algorithm",
    "RolloutRef",
    "SkippedGroup",
    "TrainSample",
    "TrainStepArgs",
    "TrainStepResult",
    "TrainerCheckpointRef",
    "TrainerSettings",
    "algorithm",
]

TRAIN_STEP = Activity("trainer.train_step", TrainStepArgs, TrainStepResult)
# The weights a run starts from, stored from the trainer's own model: version 0 of the run.
START_WEIGHTS = Activity("trainer.start_weights", StartWeightsArgs, ObjectRef)
