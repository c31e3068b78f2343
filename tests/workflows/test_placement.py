"""Placement in the workflow, on the real stack: with the host publishing its load, a new
sandbox is created on that host's own queue after `sandbox.place` names it; while every
host is full the trajectory waits for room and starts as soon as there is some."""

from __future__ import annotations

import asyncio

from belayer.client import trajectory_progress
from belayer.sandbox.placement import LoadPublisher
from belayer.workloads.models import TraceTask, TraceTurn
from tests.workflows.test_trajectory import start

SHORT = TraceTask(
    id="placed",
    setup=["mkdir -p /workspace/p"],
    turns=[TraceTurn(think_tokens=4, bash="echo hi > /workspace/p/f && cat /workspace/p/f")],
    check="test -s /workspace/p/f",
)


async def scheduled(handle) -> list[tuple[str, str]]:
    """(activity type, task queue) of every activity the workflow scheduled."""
    calls = []
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            attrs = event.activity_task_scheduled_event_attributes
            calls.append((attrs.activity_type.name, attrs.task_queue.name))
    return calls


async def test_a_new_sandbox_is_created_on_the_host_placement_names(stack):
    host = stack.sandboxes.host
    publisher = LoadPublisher(host).start()
    try:
        handle = await start(stack, SHORT)
        result = await handle.result()
    finally:
        await asyncio.to_thread(publisher.stop)
    assert result.status == "completed", result.reason
    calls = await scheduled(handle)
    assert ("sandbox.place", stack.queues.sandbox) in calls
    assert ("sandbox.create", host.host_queue) in calls
    assert ("sandbox.create", stack.queues.sandbox) not in calls


async def test_while_every_host_is_full_a_trajectory_waits_for_room(stack):
    host = stack.sandboxes.host
    host.cfg = host.cfg.model_copy(update={"max_sandboxes": 1})
    publisher = LoadPublisher(host).start()
    try:
        other = await asyncio.to_thread(stack.sandboxes.create)  # the one slot, taken
        handle = await start(stack, SHORT)
        await asyncio.sleep(3.0)
        progress = await trajectory_progress(handle)
        assert progress.sandbox is None  # waiting for room, not failed, not squeezed in
        assert [name for name, _ in await scheduled(handle)].count("sandbox.create") == 0
        await asyncio.to_thread(host.destroy, other)
        result = await handle.result()
    finally:
        await asyncio.to_thread(publisher.stop)
    assert result.status == "completed" and result.reward == 1.0, result.reason
    calls = await scheduled(handle)
    assert calls.count(("sandbox.place", stack.queues.sandbox)) >= 2  # asked again once there was room
    assert ("sandbox.create", host.host_queue) in calls
