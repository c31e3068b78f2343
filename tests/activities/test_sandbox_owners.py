"""A sandbox started by an activity whose workflow is terminated meanwhile is still the
reaper's: its owner is recorded by the thread that starts it, not after the activity's await.

A soak found the leak: a trajectory terminated from Temporal while its recovery restored
its sandbox; Temporal cancelled the activity, the restore's thread went on, and the
sandbox it made had no owner record, so the reaper (which judges only what workflows own)
left it running until the host was drained.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
from temporalio.testing import ActivityEnvironment

from belayer.activities.sandbox import SandboxActivities
from belayer.contracts.sandbox import CreateSandboxArgs
from belayer.sandbox.reaper import OwnerRecords

SANDBOX = "sbx-0123456789abcdef"


class SlowHost:
    """A host whose create waits until the test lets it finish."""

    def __init__(self, state_dir):
        self.owners = OwnerRecords(state_dir, "host-a")
        self.entered, self.release, self.finished = threading.Event(), threading.Event(), threading.Event()

    def create(self, spec, sandbox_id):
        self.entered.set()
        assert self.release.wait(30), "the test never let the create finish"
        self.finished.set()
        return dataclasses.make_dataclass("Handle", ["sandbox_id"])(sandbox_id)


async def test_a_sandbox_started_after_its_activity_was_cancelled_is_owned_by_its_workflow(tmp_path):
    host = SlowHost(tmp_path)
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id="traj-terminated")
    running = asyncio.ensure_future(
        env.run(SandboxActivities(host).create, CreateSandboxArgs(sandbox_id=SANDBOX))
    )
    assert await asyncio.to_thread(host.entered.wait, 30)
    env.cancel()  # what Temporal does when the workflow is terminated
    with pytest.raises(asyncio.CancelledError):
        await running
    assert host.owners.owner(SANDBOX) is None  # nothing started yet

    host.release.set()  # the restore's thread goes on and starts the sandbox
    assert await asyncio.to_thread(host.finished.wait, 30)
    for _ in range(300):  # the record follows the start in the same thread
        if host.owners.owner(SANDBOX) is not None:
            break
        await asyncio.sleep(0.01)
    assert host.owners.owner(SANDBOX) == "traj-terminated"
