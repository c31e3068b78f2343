"""Trajectories survive their own infrastructure: the workflow worker killed, the Temporal
server restarted, the sandbox worker killed. Real processes, real SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid

import pytest
from temporalio.worker import Worker

from belayer.activities.sandbox import SandboxActivities
from belayer.stack.workers import write_effective_config
from tests.workflows.test_trajectory import STATEFUL_TRACE, start, wait_for_step

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]


def spawn(module: str, config) -> subprocess.Popen:
    env = dict(os.environ, BELAYER_CONFIG=str(write_effective_config(config)), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", module], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture
def worker_config(stack_config, tmp_path, stack):
    """The session's services, this test's queues, a state dir of its own for pid files."""
    return stack_config.model_copy(update={
        "state_dir": tmp_path,
        "storage": stack.store.cfg,
        "temporal": stack_config.temporal.model_copy(update={
            "workflow_task_queue": stack.queues.context}),
    })


async def test_workflow_worker_killed_mid_run_resumes(stack, worker_config, tokenizer_path):
    reference = await (await start(stack, STATEFUL_TRACE)).result()
    # Stop the in-process workflow worker: from now on the subprocess runs the workflow.
    await stack.stop_workflow_worker()
    first = spawn("belayer.workers.trajectory", worker_config)
    try:
        handle = await start(stack, STATEFUL_TRACE)
        await wait_for_step(handle, 3)
        kill(first)
        second = spawn("belayer.workers.trajectory", worker_config)
        try:
            result = await asyncio.wait_for(handle.result(), timeout=240)
        finally:
            kill(second)
    finally:
        kill(first)
    assert result.status == "completed", result.reason
    assert (result.token_sha256, result.env_sha256) == (reference.token_sha256, reference.env_sha256)


async def test_temporal_server_restarted_mid_run_loses_nothing(stack, temporal_server):
    reference = await (await start(stack, STATEFUL_TRACE)).result()
    handle = await start(stack, STATEFUL_TRACE)
    await wait_for_step(handle, 3)
    temporal_server.kill()
    await asyncio.sleep(1)
    temporal_server.start()
    result = await asyncio.wait_for(handle.result(), timeout=240)
    assert result.status == "completed", result.reason
    assert (result.token_sha256, result.env_sha256) == (reference.token_sha256, reference.env_sha256)


async def test_sandbox_worker_killed_mid_run_recovers(stack):
    """The host's worker dies; a new worker on the same host queue picks the sandbox up."""
    reference = await (await start(stack, STATEFUL_TRACE)).result()
    await stack.stop_sandbox_workers()
    handle = await start(stack, STATEFUL_TRACE)
    activities = SandboxActivities(stack.sandboxes.host)
    queues = [stack.queues.sandbox, stack.sandboxes.host.host_queue]

    def host_worker(queue: str) -> Worker:
        return Worker(stack.client, task_queue=queue, activities=activities.all(),
                      identity=f"host-{uuid.uuid4().hex[:6]}")

    first = [host_worker(q) for q in queues]
    runs = [asyncio.create_task(w.run()) for w in first]
    await wait_for_step(handle, 3)
    # An abrupt stop: the worker's in-flight tasks are abandoned, not finished.
    for run in runs:
        run.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
    second = [host_worker(q) for q in queues]
    runs = [asyncio.create_task(w.run()) for w in second]
    try:
        result = await asyncio.wait_for(handle.result(), timeout=240)
    finally:
        await asyncio.gather(*(w.shutdown() for w in second), return_exceptions=True)
        await asyncio.gather(*runs, return_exceptions=True)
    assert result.status == "completed", result.reason
    assert (result.token_sha256, result.env_sha256) == (reference.token_sha256, reference.env_sha256)
