"""Start a Belayer trajectory from your own code with the Temporal client.

    .venv/bin/belayer up                       # the local stack and Belayer's workers
    .venv/bin/python examples/start_trajectory.py

The typed models are the public API: `TrajectoryInput` in, `TrajectoryResult` out, and
`TrajectoryProgress` snapshots while it runs (`belayer.client.follow_trajectories`). Connect through
`belayer.temporal_client.connect`: it reads the same configuration as `belayer up`
(address, namespace, task queues) and uses the same data converter as the workers:
Temporal's pydantic converter, plus payload encryption when `temporal.encrypt_payloads`
is on. A client built by hand would fail to read encrypted results.
"""

from __future__ import annotations

import asyncio
import os
import uuid

from temporalio.client import Client

from belayer.client import follow_trajectories
from belayer.config import load_config
from belayer.temporal_client import connect
from belayer.workflows.models import TaskQueues, TrajectoryInput, TrajectoryResult
from belayer.workloads.models import TraceTask, TraceTurn

TASK = TraceTask(
    id="example-hello",
    setup=["mkdir -p /workspace/hello"],
    turns=[
        TraceTurn(think_tokens=16, bash="cd /workspace/hello && echo 'print(6 * 7)' > answer.py"),
        TraceTurn(think_tokens=16, bash="python3 answer.py | tee answer.txt"),
    ],
    check='test "$(cat /workspace/hello/answer.txt)" = 42',
)


async def run_trajectory(
    client: Client, workflow_queue: str, queues: TaskQueues, task: TraceTask = TASK
) -> TrajectoryResult:
    """Start one trajectory, print its progress while it runs, return its result."""
    trajectory_id = f"{task.id}-{uuid.uuid4().hex[:6]}"
    handle = await client.start_workflow(
        "TrajectoryWorkflow",
        TrajectoryInput(trajectory_id=trajectory_id, task=task, queues=queues),
        id=trajectory_id,
        task_queue=workflow_queue,
        result_type=TrajectoryResult,
    )
    async for progress in follow_trajectories(handle, every_s=1.0):
        print(
            f"{trajectory_id}: step {progress.step}, {progress.tokens} tokens, "
            f"{progress.checkpoints_taken} checkpoints"
        )
    return await handle.result()


async def main() -> None:
    config = load_config()
    client = await connect(config.temporal, config.storage.encryption_key)
    result = await run_trajectory(
        client,
        config.temporal.workflow_task_queue,
        TaskQueues(rollout=config.temporal.rollout_task_queue, context=config.temporal.workflow_task_queue),
    )
    print(
        f"{result.trajectory_id}: {result.status}, reward {result.reward}, "
        f"token_sha256 {result.token_sha256[:12]}, env_sha256 {result.env_sha256[:12]}"
    )


if __name__ == "__main__":
    asyncio.run(main())
    os._exit(0)  # the SDK can abort at interpreter exit in short scripts (docs/design.md §7)
