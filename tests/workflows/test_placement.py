"""Placement in the workflow, on the real stack: with the host publishing its load, a new
sandbox is created on that host's own queue after `sandbox.place` names it; while every
host is full the trajectory waits for room and starts as soon as there is some."""

from __future__ import annotations

import asyncio

from temporalio.worker import Worker

from belayer.activities.sandbox import SandboxActivities
from belayer.client import trajectory_progress
from belayer.sandbox.placement import LoadPublisher
from belayer.workloads.models import TraceTask, TraceTurn
from tests.sandbox.conftest import make_sandboxes
from tests.workflows.test_groups import members, run_group
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


SPREAD = TraceTask(
    id="spread",
    setup=["mkdir -p /workspace/s && seq 1 50 > /workspace/s/n"],
    turns=[TraceTurn(think_tokens=4, bash="wc -l < /workspace/s/n")],
    check="test -s /workspace/s/n",
)


async def test_a_group_of_8_spreads_its_forks_over_two_hosts_with_room_for_4_each(stack, storage_config):
    """Groups are placed like single sandboxes: the set-up sandbox on a host placement names,
    then the forks spread over the hosts with room, one fork call (one download of the
    origin) per host; no host takes more than its capacity, so no member falls back."""
    first, second_boxes = stack.sandboxes.host, make_sandboxes(storage_config)
    second = second_boxes.host
    for host in (first, second):
        host.cfg = host.cfg.model_copy(update={"max_sandboxes": 4})
    worker = Worker(stack.client, task_queue=second.host_queue, activities=SandboxActivities(second).all())
    serving = asyncio.create_task(worker.run())
    publishers = [LoadPublisher(host).start() for host in (first, second)]
    try:
        group = await run_group(stack, members(stack, SPREAD, 8, policy="none"))
    finally:
        for publisher in publishers:
            await asyncio.to_thread(publisher.stop)
        await worker.shutdown()
        await asyncio.gather(serving, return_exceptions=True)
        leaked = await asyncio.to_thread(second_boxes.cleanup)
        second.store.close()
    record = group.group
    assert (record.forked, record.fallback, record.notes) == (8, "", []), record
    assert record.fork_hosts == {first.host_queue: 4, second.host_queue: 4}, record.fork_hosts
    assert all(r.status == "completed" and r.reward == 1.0 for r in group.results), group.results
    assert len({(r.token_sha256, r.env_sha256) for r in group.results}) == 1  # forks of one sandbox, alike
    assert not leaked, leaked
    calls = await scheduled(stack.client.get_workflow_handle(record.group))
    assert [queue for name, queue in calls if name == "sandbox.create"] in (
        [first.host_queue],
        [second.host_queue],
    )
    forks = sorted(queue for name, queue in calls if name == "sandbox.fork")
    assert forks == sorted([first.host_queue, second.host_queue])  # one call, one download, per host
