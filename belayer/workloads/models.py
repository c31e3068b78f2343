"""A workload: the tasks `belayer run` starts trajectories for, and the `Task` union.

The task models of each kind are in `tasks.py` (re-exported here, where callers have always
found them); `Task` is the union of the registered kinds' models (`registry.DRIVERS`),
told apart by `kind`, or by the fields a task has when it names none (`registry.task_kind`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from belayer.model.build import ModelSize
from belayer.workloads.registry import DRIVERS, task_kind
from belayer.workloads.tasks import TASK_ID_PATTERN, ModelTask, TaskBase, TraceTask, TraceTurn

__all__ = [
    "TASK_ID_PATTERN", "HarborSource", "ModelTask", "Task", "TaskBase", "TraceTask", "TraceTurn", "Workload",
]  # fmt: skip

Task = Annotated[
    Union[tuple(Annotated[driver.model, Tag(driver.kind)] for driver in DRIVERS)],  # noqa: UP007 (built at runtime)
    Discriminator(task_kind),
]


class HarborSource(BaseModel):
    """A Harbor task directory or dataset a workload lists, and how its tasks are judged."""

    model_config = ConfigDict(extra="forbid")

    path: Path = Field(description="The task directory or dataset (relative to the workload file).")
    freeze_agent: bool = Field(
        False,
        description="Stop the agent's processes while these tasks' tests run (Harbor lets them run: a "
        "process left behind could change what the tests read). Its tasks' tests must not need them.",
    )


class Workload(BaseModel):
    """A validated workload: at least one task (its own, or Harbor's), unique ids."""

    model_config = ConfigDict(extra="forbid")

    tasks: list[Task] = Field(default_factory=list)
    model: ModelSize | None = Field(
        None,
        description="The project-built model the tasks were made for; `belayer train` starts from it "
        "(and publishes it into the engines) instead of the stack's served model.",
    )
    heldout: Path | None = Field(
        None,
        description="A workload of held-out tasks `belayer train` evaluates every iteration, or a Harbor "
        "dataset (relative to this file).",
    )
    lr: float | None = Field(
        None,
        ge=0,
        description="The learning rate `belayer train` uses on these tasks unless `--lr` is given: the "
        "one they were tuned with.",
    )
    group_size: int | None = Field(
        None, ge=2, le=256, description="Likewise the group size (`--group-size`) they were tuned with."
    )
    kl_coef: float | None = Field(
        None, ge=0, description="Likewise the KL penalty's weight (`--kl-coef`) they were tuned with."
    )
    harbor: list[HarborSource] = Field(
        default_factory=list,
        description="Harbor task directories or datasets run beside `tasks` (a path, or `{path, "
        "freeze_agent}`): `belayer run` and `belayer train` build their images and add them "
        "(belayer.workloads.harbor_tasks).",
    )

    @model_validator(mode="after")
    def _some_task(self) -> Workload:
        if not self.tasks and not self.harbor:
            raise ValueError(
                "a workload needs at least one task under `tasks:` or a Harbor path under `harbor:`"
            )
        return self
