"""Every sandbox failure ends the trajectory with a result, and a cut is a cut in every phase.

Real faults on the real stack: the container killed (podman kill, or the host's
`sandbox_kill_during_exec` fault point during a recovery's replay), checkpoint archives
overwritten with garbage in the object store, a supervisor that does not come up within
the host's start timeout. "Bounded" means: the result arrives under the test's generous
timeout, with status failed_infra and a reason; a workflow that hangs (its task retried
forever) fails the test by that timeout and is terminated.
"""

from __future__ import annotations

import asyncio
import contextlib

from temporalio.client import WorkflowHandle

from belayer import faults
from belayer.stack.sandboxes import list_sandboxes
from belayer.workers.sandbox.worker import reap_round
from belayer.workflows.models import TrajectoryProgress, TrajectoryResult
from belayer.workloads.models import ModelTask, TraceTask, TraceTurn
from tests.workflows.conftest import trajectory_stack
from tests.workflows.test_trajectory import start, wait_for_progress, wait_for_step

RESULT_TIMEOUT_S = 240

SLOW_TRACE = TraceTask(
    id="slow",
    setup=["mkdir -p /workspace/w"],
    turns=[
        TraceTurn(think_tokens=8, bash=f"sleep 0.5; echo {i} >> /workspace/w/log; echo {i}")
        for i in range(1, 6)
    ],
    check="test -s /workspace/w/log",
)


async def result_within(handle: WorkflowHandle) -> TrajectoryResult:
    """The result, or a failure (and a terminated workflow) when none comes in time."""
    try:
        return await asyncio.wait_for(handle.result(), RESULT_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(Exception):
            await handle.terminate("test timed out: the trajectory never ended")
        raise AssertionError(f"trajectory {handle.id} did not end within {RESULT_TIMEOUT_S}s") from None


async def wait_for_recorded_steps(handle: WorkflowHandle, steps: int) -> TrajectoryProgress:
    """Until `steps` steps are logged (a decision is recorded after each action's observation)."""
    return await wait_for_progress(
        handle, lambda p: p.decisions >= steps, f"logged {steps} steps", tries=1200
    )


async def test_recover_whose_replay_kills_the_new_sandbox_ends_failed_infra(stack, monkeypatch):
    """Every exec kills its container from step 3 on: each recover's replay loses its new
    sandbox too. Each failed recover is recorded; max_recoveries ends it as failed_infra."""
    handle = await start(stack, SLOW_TRACE, policy="none", max_recoveries=2)
    await wait_for_step(handle, 2)
    monkeypatch.setenv(faults.ENV, "sandbox_kill_during_exec")
    result = await result_within(handle)
    assert result.status == "failed_infra" and result.reward is None
    assert "after 2 recoveries" in result.reason, result.reason
    assert len(result.recoveries) == 2
    assert all(r.failed and r.source == "failed" and not r.consistent for r in result.recoveries)
    assert all("SandboxUnreachable" in r.notes[0] for r in result.recoveries), result.recoveries


async def test_corrupt_checkpoints_and_a_fallback_create_that_times_out_end_failed_infra(stack, monkeypatch):
    """Every checkpoint archive is garbage and the fresh sandbox's supervisor does not come
    up in time: the recover fails; its record names the skipped checkpoints. (A checkpoint
    still in flight when the archives are overwritten is damaged by the host's fault point.)"""
    handle = await start(stack, SLOW_TRACE, policy="every-step", max_recoveries=2)
    progress = await wait_for_recorded_steps(handle, 3)
    host = stack.sandboxes.host
    prefix = f"{host.cfg.checkpoint_prefix}{progress.sandbox.sandbox_id}/"
    archives = [key for key in stack.store.list(prefix) if key.endswith("/archive")]
    assert archives, "no checkpoint was taken"
    for key in archives:
        stack.store.put_bytes(key, b"garbage, not a checkpoint")
    monkeypatch.setenv(faults.ENV, "sandbox_restore_damaged_archive")
    host.cfg = host.cfg.model_copy(update={"start_timeout_s": 1e-9})
    stack.sandboxes.backend.podman("kill", progress.sandbox.container, check=False)
    result = await result_within(handle)
    assert result.status == "failed_infra" and result.reward is None, result
    assert result.reason, result
    assert result.recoveries and all(r.failed for r in result.recoveries)
    notes = result.recoveries[0].notes[0]
    assert "did not start within" in notes and "unusable" in notes, notes


async def test_create_that_keeps_failing_ends_failed_infra(stack):
    """No sandbox can be created (its supervisor never answers in time): failed_infra, not a hang."""
    host = stack.sandboxes.host
    host.cfg = host.cfg.model_copy(update={"start_timeout_s": 1e-9})
    result = await result_within(await start(stack, SLOW_TRACE))
    assert result.status == "failed_infra" and result.reward is None
    assert "sandbox.create failed" in result.reason and "did not start within" in result.reason, result.reason
    assert result.turns == 0


CLOCK_TASK = ModelTask(
    id="clock-last-turn",
    instruction="Write the time into /workspace/stamp.",
    max_turns=4,
    setup=["mkdir -p /workspace/w"],
    # Slow enough that the test kills the sandbox while it runs.
    check="sleep 3; test -s /workspace/w/stamp",
)


async def test_cut_found_while_recovering_for_the_check_resumes_generation(
    temporal_server, seaweedfs, sandbox_runtime, stack_config, storage_config, tokenizer_path
):
    """The last action is nondeterministic; the sandbox dies during the check. Replay from
    the start finds the new time: the context is cut after that action, the new observation
    is appended (a forked token log), the model generates again from there, and only then
    does the check run -- on the sandbox the context now describes."""
    replies = ["<bash>date +%s%N | tee /workspace/w/stamp</bash>", "The time is written."]
    async with trajectory_stack(stack_config, storage_config, tokenizer_path, replies=replies) as stack:
        handle = await start(stack, CLOCK_TASK, policy="none")
        progress = await wait_for_recorded_steps(handle, 1)
        # The model has stopped; the check (sleep 3) is what runs now.
        for _ in range(200):
            if stack.rollout.calls >= 2:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        stack.sandboxes.backend.podman("kill", progress.sandbox.container, check=False)
        result = await result_within(handle)
        assert result.status == "completed" and result.reward == 1.0, result
        cuts = [r for r in result.recoveries if r.cut_after_step is not None]
        assert len(cuts) == 1 and cuts[0].cut_after_step == 1 and not cuts[0].consistent, result.recoveries
        assert stack.rollout.calls == 3, "the model did not generate again after the cut"
        assert result.turns == 1
        logs = sorted(stack.store.list(f"trajectories/{result.trajectory_id}/tokens/"))
        assert any("/tokens/v1" in key for key in logs), logs


async def test_a_trajectory_terminated_from_temporal_leaves_no_sandbox(stack, stack_config):
    """Terminated, the workflow runs no code to destroy its sandbox: the sandbox worker's
    reaper finds its workflow closed and removes it, and leaves an open one's alone.
    `belayer sandboxes` lists each with the workflow it serves, before and after."""
    terminated = await start(stack, SLOW_TRACE, policy="none")
    running = await start(stack, SLOW_TRACE, policy="none")
    doomed = (await wait_for_step(terminated, 1)).sandbox.sandbox_id
    kept = (await wait_for_step(running, 1)).sandbox.sandbox_id
    host = stack.sandboxes.host
    assert host.owners.owner(doomed) == terminated.id  # recorded by the real create activity
    config = stack_config.model_copy(deep=True)  # `belayer sandboxes` as this host's stack sees it
    config.state_dir, config.sandbox.host_task_queue = host.state_dir, host.host_queue
    listed = {s.sandbox_id: s for s in (await list_sandboxes(config, 1, stack.client)).sandboxes}
    assert (listed[doomed].trajectory, listed[doomed].workflow_status) == (terminated.id, "RUNNING")
    assert listed[doomed].state == "running" and listed[doomed].memory_bytes > 0 and listed[doomed].age_s >= 0
    await terminated.terminate("the user stopped it from the web UI")

    reaped = await reap_round(stack.client, host)  # (earlier tests' closed workflows' sandboxes too, if any)

    ours = [
        (r.sandbox_id, r.workflow_id, r.workflow_status)
        for r in reaped
        if r.workflow_id in (terminated.id, running.id)
    ]
    assert ours == [(doomed, terminated.id, "TERMINATED")]
    live = host.backend.lineages()
    assert doomed not in live and host.owners.owner(doomed) is None
    assert doomed not in {s.sandbox_id for s in (await list_sandboxes(config, 1, stack.client)).sandboxes}
    assert kept in live or (await running.describe()).status.name == "COMPLETED"
    result = await result_within(running)
    assert result.status == "completed" and result.reward == 1.0, result.reason
