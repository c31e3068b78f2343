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

from belayer.stack.workers import write_effective_config
from tests.workflows.test_trajectory import STATEFUL_TRACE, start, wait_for_step


def spawn(module: str, config, config_dir) -> subprocess.Popen:
    """`python -m module` with `config`, written to a file of its own in `config_dir`."""
    config_file = write_effective_config(config, config_dir / f"{module}.toml")
    env = dict(os.environ, BELAYER_CONFIG=str(config_file), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", module],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture
def worker_config(stack_config, tmp_path, stack):
    """The session's services, this test's queues, a state dir of its own for pid files."""
    return stack_config.model_copy(
        update={
            "state_dir": tmp_path,
            "storage": stack.store.cfg,
            "temporal": stack_config.temporal.model_copy(
                update={"workflow_task_queue": stack.queues.context}
            ),
        }
    )


async def test_workflow_worker_killed_mid_run_resumes(stack, worker_config, tokenizer_path):
    reference = await (await start(stack, STATEFUL_TRACE)).result()
    # Stop the in-process workflow worker: from now on the subprocess runs the workflow.
    await stack.stop_workflow_worker()
    first = spawn("belayer.workers.trajectory", worker_config, worker_config.state_dir)
    try:
        handle = await start(stack, STATEFUL_TRACE)
        await wait_for_step(handle, 3)
        kill(first)
        second = spawn("belayer.workers.trajectory", worker_config, worker_config.state_dir)
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


async def test_sandbox_worker_killed_mid_run_recovers(stack, stack_config, tmp_path):
    """The host's worker process is SIGKILLed mid-trajectory; the restarted worker on the
    same host queue picks the running sandbox up again."""
    from belayer.activities.sandbox import SHARED_QUEUE
    from belayer.sandbox import runtime
    from belayer.sandbox.podman import PodmanBackend

    reference = await (await start(stack, STATEFUL_TRACE)).result()
    await stack.stop_sandbox_workers()
    host_queue = f"sandbox-host-{uuid.uuid4().hex[:8]}"
    config = stack_config.model_copy(
        update={
            "state_dir": runtime.default_state_dir(),  # where the base image lives
            "storage": stack.store.cfg,
            "sandbox": stack.sandboxes.host.cfg.model_copy(update={"host_task_queue": host_queue}),
        }
    )
    stack.queues = stack.queues.model_copy(update={"sandbox": SHARED_QUEUE})
    first = spawn("belayer.workers.sandbox", config, config_dir=tmp_path)
    second = None
    sandbox_id = None
    try:
        handle = await start(stack, STATEFUL_TRACE)
        progress = await wait_for_step(handle, 3)
        sandbox_id = progress.sandbox.sandbox_id
        kill(first)
        second = spawn("belayer.workers.sandbox", config, config_dir=tmp_path)
        result = await asyncio.wait_for(handle.result(), timeout=240)
    finally:
        kill(first)
        if second is not None:
            kill(second)
        if sandbox_id:
            PodmanBackend(config.sandbox, config.state_dir, config.cache_dir).destroy(sandbox_id)
    assert result.status == "completed", result.reason
    assert (result.token_sha256, result.env_sha256) == (reference.token_sha256, reference.env_sha256)
