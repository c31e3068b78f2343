"""Sandbox activities through a real Temporal dev server and real podman + CRIU.

A small workflow holds only the handle and refs, as a trajectory workflow does:
create -> exec -> checkpoint -> workspace_hash -> recover (generation + 1, from the step
log a test activity writes as the context activity would) -> a call with the superseded
handle fails with a non-retryable StaleGeneration -> destroy. Observations come back as
pointers; the test reads their text from the store.
"""

from __future__ import annotations

import concurrent.futures
import uuid
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from belayer.activities.sandbox import (
        CheckpointArgs,
        CheckpointResult,
        CreateSandboxArgs,
        CreateSandboxResult,
        DestroyArgs,
        DestroyResult,
        ExecArgs,
        ExecResult,
        RecoverArgs,
        RecoverResult,
        WorkspaceHashArgs,
        WorkspaceHashResult,
    )
    from belayer.sandbox.models import Action, SandboxSpec
    from belayer.storage.recordlog import RecordLogRef
    from belayer.storage.tokenlog import PrefixRef
    from belayer.trajectory_log import StepRecord

T = timedelta(seconds=120)
ONCE = RetryPolicy(maximum_attempts=1)
STEPS = RecordLogRef(key="trajectories/wf/steps/v0", length=1)
# The context a checkpoint after step 1 records, and the step log says step 1 left.
CONTEXT = PrefixRef(
    key="trajectories/wf/tokens/v0",
    length=0,
    sha256="e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
)


class StepLogWriter:
    """Writes the step log, as the context activity does in a trajectory."""

    def __init__(self, store):
        self.store = store

    @activity.defn(name="test.write_step")
    def write_step(self, record: StepRecord) -> None:
        from belayer.trajectory_log import start_steps, write_step

        start_steps(self.store, STEPS.key)
        write_step(self.store, STEPS.key, record)


@workflow.defn
class SandboxRoundTrip:
    @workflow.run
    async def run(self, spec: SandboxSpec) -> dict:
        h = (
            await workflow.execute_activity(
                "sandbox.create",
                CreateSandboxArgs(spec=spec),
                result_type=CreateSandboxResult,
                start_to_close_timeout=T,
            )
        ).handle
        cmd = "cd /workspace && export X=41 && echo $((X+1)) | tee answer"
        obs = (
            await workflow.execute_activity(
                "sandbox.exec",
                ExecArgs(handle=h, action=Action(trajectory="wf", step=1, command=cmd)),
                result_type=ExecResult,
                task_queue=h.host_queue,
                start_to_close_timeout=T,
            )
        ).observation
        ck = (
            await workflow.execute_activity(
                "sandbox.checkpoint",
                CheckpointArgs(handle=h, token_prefix_len=CONTEXT.length, token_prefix_sha256=CONTEXT.sha256),
                result_type=CheckpointResult,
                task_queue=h.host_queue,
                start_to_close_timeout=T,
            )
        ).checkpoint
        digest = (
            await workflow.execute_activity(
                "sandbox.workspace_hash",
                WorkspaceHashArgs(handle=h),
                result_type=WorkspaceHashResult,
                task_queue=h.host_queue,
                start_to_close_timeout=T,
            )
        ).sha256
        step = StepRecord(step=1, command=cmd, observation=obs, context_after_action=CONTEXT)
        await workflow.execute_activity("test.write_step", step, start_to_close_timeout=T)
        out = (
            await workflow.execute_activity(
                "sandbox.recover",
                RecoverArgs(handle=h, trajectory_id="wf", checkpoints=[ck], steps=STEPS),
                result_type=RecoverResult,
                start_to_close_timeout=T,
            )
        ).outcome
        stale = None
        try:
            await workflow.execute_activity(
                "sandbox.exec",
                ExecArgs(handle=h, action=Action(trajectory="wf", step=2, command="echo no")),
                result_type=ExecResult,
                task_queue=h.host_queue,
                start_to_close_timeout=T,
                retry_policy=ONCE,
            )
        except ActivityError as err:
            cause = err.cause
            assert isinstance(cause, ApplicationError)
            stale = {"type": cause.type, "non_retryable": cause.non_retryable}
        again = (
            await workflow.execute_activity(
                "sandbox.exec",
                ExecArgs(
                    handle=out.handle, action=Action(trajectory="wf", step=2, command="cat answer; echo $X")
                ),
                result_type=ExecResult,
                task_queue=out.handle.host_queue,
                start_to_close_timeout=T,
            )
        ).observation
        digest2 = (
            await workflow.execute_activity(
                "sandbox.workspace_hash",
                WorkspaceHashArgs(handle=out.handle),
                result_type=WorkspaceHashResult,
                task_queue=out.handle.host_queue,
                start_to_close_timeout=T,
            )
        ).sha256
        deleted = (
            await workflow.execute_activity(
                "sandbox.destroy",
                DestroyArgs(handle=out.handle, delete_checkpoints=True),
                result_type=DestroyResult,
                task_queue=out.handle.host_queue,
                start_to_close_timeout=T,
            )
        ).deleted_objects
        return {"first": obs, "source": out.source, "generation": out.handle.generation, "stale": stale,
                "again": again, "same_hash": digest == digest2, "deleted": deleted}  # fmt: skip


async def test_activities_round_trip(sandboxes, temporal_server, stack_config):
    from temporalio.worker import Worker

    from belayer.activities.sandbox import SandboxActivities
    from belayer.sandbox.models import ObservationRef
    from belayer.sandbox.observations import load_observation
    from belayer.temporal_client import connect

    queue = f"belayer-sandbox-test-{uuid.uuid4().hex[:8]}"
    sandboxes.host.host_queue = queue
    client = await connect(stack_config.temporal, stack_config.storage.encryption_key)
    acts = SandboxActivities(sandboxes.host)
    writer = StepLogWriter(sandboxes.host.store)
    async with Worker(
        client,
        task_queue=queue,
        workflows=[SandboxRoundTrip],
        activities=[*acts.all(), writer.write_step],
        activity_executor=concurrent.futures.ThreadPoolExecutor(2),
    ):
        result = await client.execute_workflow(
            SandboxRoundTrip.run,
            sandboxes.spec(),
            id=f"sbx-roundtrip-{uuid.uuid4().hex[:8]}",
            task_queue=queue,
            execution_timeout=timedelta(minutes=5),
        )
    first, again = (
        load_observation(sandboxes.host.store, ObservationRef.model_validate(result[k]))
        for k in ("first", "again")
    )
    assert first.stdout == "42\n"
    assert result["source"].startswith("checkpoint@") and result["generation"] == 1
    assert result["stale"] == {"type": "StaleGeneration", "non_retryable": True}
    assert again.stdout == "42\n41\n"
    assert result["same_hash"] and result["deleted"] >= 2


def test_translator_maps_kinds():
    from belayer.activities.runtime import to_application_error
    from belayer.sandbox.errors import SandboxBusy, StaleGeneration
    from belayer.storage.errors import TransientStorageError

    e = to_application_error(StaleGeneration("old"))
    assert isinstance(e, ApplicationError) and e.type == "StaleGeneration" and e.non_retryable
    e = to_application_error(SandboxBusy("busy"))
    assert e.type == "SandboxBusy" and not e.non_retryable
    e = to_application_error(TransientStorageError("down"))
    assert e.type == "TransientStorageError" and not e.non_retryable
    other = KeyError("x")
    assert to_application_error(other) is other
