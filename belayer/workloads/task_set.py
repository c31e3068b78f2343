"""A training run's tasks by reference: stored once in the object store, named in the
run's input by key and sha256, and drawn from by an activity each iteration.

Temporal refuses a payload over 2 MB and a history over 50 MB, and a run's input is in
every one of its histories (it is carried through continue-as-new): a dataset of 100,000
tasks inline would be refused at start. Stored, the input holds a pointer of a few hundred
bytes, whatever the dataset's size; an iteration's draw is the only part that travels.

The key is the sha256 of the tasks' canonical JSON, so the same tasks are one object, and a
run started again with them is the same run (`belayer.training.claim_run_id`).
"""

from __future__ import annotations

import functools
import hashlib

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from belayer.seeding import digest
from belayer.workloads.models import Task

TASKS = TypeAdapter(list[Task])


class TaskSetRef(BaseModel):
    """The tasks stored at `key` (their canonical JSON, whose sha256 is `sha256`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    count: int = Field(ge=1, description="How many tasks it holds.")


def task_set_key(sha256: str) -> str:
    return f"task-sets/{sha256}.json"


def encoded(tasks: list[Task]) -> tuple[TaskSetRef, bytes]:
    """`tasks` as they are stored, and the reference that names them."""
    data = TASKS.dump_json(tasks)
    sha256 = hashlib.sha256(data).hexdigest()
    return TaskSetRef(key=task_set_key(sha256), sha256=sha256, count=len(tasks)), data


def store_task_set(store, tasks: list[Task]) -> TaskSetRef:
    """Store `tasks` under their own hash (a set stored before is left as it is)."""
    ref, data = encoded(tasks)
    store.put_bytes(ref.key, data, if_absent=True)
    return ref


def load_task_set(store, ref: TaskSetRef) -> list[Task]:
    """The tasks `ref` names, checked against its sha256. The last few sets read are kept
    in memory: a run draws from the same set every iteration."""
    return list(_load(store, ref.key, ref.sha256))


@functools.lru_cache(maxsize=4)
def _load(store, key: str, sha256: str) -> tuple[Task, ...]:
    return tuple(TASKS.validate_json(store.get_bytes(key, expected_sha256=sha256)))


def pick(tasks: list[Task], seed: int, iteration: int, count: int) -> list[Task]:
    """`count` distinct tasks of `tasks`, ranked by a hash of (seed, iteration, task id)."""
    return sorted(tasks, key=lambda task: digest(seed, iteration, task.id))[:count]
