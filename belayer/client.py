"""Starting and following trajectories from Python: what `belayer run` uses.

The typed `TrajectoryInput` / `TrajectoryResult` models are the public API; this module
only fills the defaults from the effective configuration (task queues, policy, token
budget) and gives workflows readable ids.
"""

from __future__ import annotations

import uuid

from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from belayer.activities.sandbox import SHARED_QUEUE
from belayer.config import BelayerConfig
from belayer.workflows.groups import GroupResult
from belayer.workflows.models import Sampling, TaskQueues, TrajectoryInput, TrajectoryResult
from belayer.workflows.trajectory import STATUS_KEY, TASK_KEY
from belayer.workloads.models import Task


def task_queues(config: BelayerConfig) -> TaskQueues:
    return TaskQueues(
        rollout=config.temporal.rollout_task_queue,
        sandbox=SHARED_QUEUE,
        context=config.temporal.workflow_task_queue,
    )


def trajectory_input(
    config: BelayerConfig, task: Task, *, repeat: int = 0, seed: int = 0, run_id: str | None = None
) -> TrajectoryInput:
    """The input of one trajectory of `task`, with a readable, unique id."""
    run_id = run_id or uuid.uuid4().hex[:6]
    return TrajectoryInput(
        trajectory_id=f"{task.id}-{run_id}-{repeat}",
        task=task,
        sampling=Sampling(seed=seed),
        policy=config.policy,
        queues=task_queues(config),
        max_total_tokens=config.rollout.max_model_len,
    )


async def start_trajectory(client: Client, config: BelayerConfig, input: TrajectoryInput) -> WorkflowHandle:
    """Start `TrajectoryWorkflow`; the web UI can filter by task and status from the first moment."""
    return await client.start_workflow(
        "TrajectoryWorkflow",
        input,
        id=input.trajectory_id,
        task_queue=config.temporal.workflow_task_queue,
        result_type=TrajectoryResult,
        search_attributes=TypedSearchAttributes(
            [
                SearchAttributePair(TASK_KEY, input.task.id),
                SearchAttributePair(STATUS_KEY, "running"),
            ]
        ),
        static_summary=f"trajectory of task {input.task.id}",
    )


async def start_group(client: Client, config: BelayerConfig, group) -> WorkflowHandle:
    """Start `TrajectoryGroupWorkflow` (belayer/workflows/groups.py): one task's members,
    forked from one set-up sandbox, each a child TrajectoryWorkflow under its own id."""

    return await client.start_workflow(
        "TrajectoryGroupWorkflow",
        group,
        id=group.group_id,
        task_queue=config.temporal.workflow_task_queue,
        result_type=GroupResult,
        search_attributes=TypedSearchAttributes([SearchAttributePair(TASK_KEY, group.members[0].task.id)]),
        static_summary=f"group of {len(group.members)} trajectories of task {group.members[0].task.id}",
    )


def ui_link(config: BelayerConfig, workflow_id: str) -> str:
    host = config.temporal.address.rpartition(":")[0]
    return f"http://{host}:{config.temporal.ui_port}/namespaces/{config.temporal.namespace}/workflows/{workflow_id}"
