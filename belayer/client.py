"""Starting and following trajectories from Python: what `belayer run` uses.

The typed `TrajectoryInput` / `TrajectoryResult` / `TrajectoryProgress` models are the
public API; this module fills the defaults from the effective configuration (task
queues, policy, token budget), gives workflows readable ids, and is the one way to follow
a trajectory while it runs (`trajectory_progress`, `follow_trajectories`).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence

from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from belayer.activities.sandbox import SHARED_QUEUE
from belayer.config import BelayerConfig
from belayer.temporal_client import server_went_away
from belayer.workflows.groups import GroupResult
from belayer.workflows.models import (
    Sampling,
    TaskQueues,
    TrajectoryInput,
    TrajectoryProgress,
    TrajectoryResult,
)
from belayer.workflows.trajectory import STATUS_KEY, TASK_KEY, TrajectoryWorkflow
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


async def start_trajectory(client: Client, config: BelayerConfig, input: TrajectoryInput, *,
                           workflow: str = "TrajectoryWorkflow", summary: str | None = None) -> WorkflowHandle:  # fmt: skip
    """Start `TrajectoryWorkflow` (or `workflow`, one of its kind: an agent session); the web
    UI can filter by task and status from the first moment."""
    return await client.start_workflow(
        workflow,
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
        static_summary=summary or f"trajectory of task {input.task.id}",
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


async def trajectory_progress(handle: WorkflowHandle) -> TrajectoryProgress:
    """What the trajectory's `progress` query answers now; raises what the query raises
    (the workflow not started yet, between two runs of its chain, its server restarting)."""
    return await handle.query(TrajectoryWorkflow.progress)


async def follow_trajectories(
    until: WorkflowHandle,
    trajectories: Sequence[WorkflowHandle] = (),
    *,
    every_s: float = 0.5,
    query_timeout_s: float | None = None,
) -> AsyncIterator[TrajectoryProgress]:
    """Each trajectory's progress (`trajectories`, or `until` itself when none are given),
    every `every_s`, until `until`'s workflow closes: a trajectory, or the group that runs
    them. A query that fails or takes longer than `query_timeout_s` is skipped (it races
    the start, the end, or a server restart); the result's long poll that a restarted
    server drops is asked again. Read the result from `until` afterwards; a caller that
    may stop early follows inside `contextlib.aclosing`, which ends the long poll."""
    watched = list(trajectories) or [until]
    closed = asyncio.ensure_future(_closed(until))
    try:
        while not closed.done():
            for handle in watched:
                try:
                    yield await asyncio.wait_for(trajectory_progress(handle), query_timeout_s)
                except Exception:  # not answering now; asked again next round
                    continue
            await asyncio.wait({closed}, timeout=every_s)
    finally:
        closed.cancel()


async def result_through_restarts(handle: WorkflowHandle):
    """The workflow's result (a trajectory's, a group's, a training run's); a restarted
    Temporal server drops the long poll, which is asked again (the workflow goes on)."""
    while True:
        try:
            return await handle.result()
        except Exception as exc:
            if not server_went_away(exc):
                raise
            await asyncio.sleep(1)


async def _closed(handle: WorkflowHandle) -> None:
    """Once `handle`'s workflow has closed (its result or its failure is in)."""
    with contextlib.suppress(Exception):
        await result_through_restarts(handle)


def ui_link(config: BelayerConfig, workflow_id: str) -> str:
    host = config.temporal.address.rpartition(":")[0]
    return f"http://{host}:{config.temporal.ui_port}/namespaces/{config.temporal.namespace}/workflows/{workflow_id}"
