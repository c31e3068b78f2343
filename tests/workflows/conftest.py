"""A real trajectory stack in-process: Temporal dev server, SeaweedFS, podman sandboxes.

Generation is the scripted rollout (belayer.testing) unless a test asks for the real
engine, so the workflow's own behaviour is tested in seconds. Every worker, sandbox,
and object a test starts is stopped or removed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass

import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from belayer.activities.context import ContextActivities
from belayer.activities.sandbox import SandboxActivities
from belayer.model.build import model_path
from belayer.storage.store import ObjectStore, open_store
from belayer.temporal_client import connect
from belayer.testing import ScriptedRollout
from belayer.workflows.groups import TrajectoryGroupWorkflow
from belayer.workflows.models import TaskQueues
from belayer.workflows.session import AgentSessionWorkflow
from belayer.workflows.trajectory import TrajectoryWorkflow
from tests.sandbox.conftest import make_sandboxes, sandbox_runtime  # noqa: F401  (fixture)


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    return model_path("tiny") / "tokenizer.json"


@dataclass
class TrajectoryStack:
    client: Client
    queues: TaskQueues
    store: ObjectStore
    sandboxes: object
    rollout: object  # ScriptedRollout, or RolloutActivities on a real node
    workers: dict[str, tuple[Worker, asyncio.Task]]

    async def _stop(self, *names: str) -> None:
        for name in names:
            worker, run = self.workers.pop(name)
            await worker.shutdown()
            await asyncio.gather(run, return_exceptions=True)

    async def stop_workflow_worker(self) -> None:
        """Leave the workflow queue to a worker the test runs itself."""
        await self._stop("workflow")

    async def replace_rollout_worker(self, activities: list) -> None:
        """The rollout queue served by `activities` from now on (e.g. a node of an older version)."""
        await self._stop("rollout")
        worker = Worker(self.client, task_queue=self.queues.rollout, activities=activities)
        self.workers["rollout"] = (worker, asyncio.create_task(worker.run()))

    async def stop_sandbox_workers(self) -> None:
        """Leave the sandbox queues to workers the test runs itself."""
        await self._stop("sandbox-shared", "sandbox-host")


@contextlib.asynccontextmanager
async def trajectory_stack(
    stack_config, storage_config, tokenizer_path, *, replies=None, per_token_s=0.001, rollout_node=None
):
    """Workers for every queue of a trajectory; `rollout_node` puts a real engine behind generate."""
    token = uuid.uuid4().hex[:8]
    queues = TaskQueues(rollout=f"rollout-{token}", sandbox=f"sandbox-{token}", context=f"wf-{token}")
    client = await connect(stack_config.temporal, stack_config.storage.encryption_key)
    store = open_store(storage_config, encrypted=False)
    boxes = make_sandboxes(storage_config)
    boxes.host.host_queue = f"sandbox-host-{token}"
    if rollout_node is not None:
        from belayer.activities.generate import RolloutActivities

        rollout = RolloutActivities(rollout_node, store, queues.rollout)
    else:
        rollout = ScriptedRollout(
            store, tokenizer_path, replies=replies, per_token_s=per_token_s, node_queue=queues.rollout
        )
    context = ContextActivities(store, tokenizer_path)
    sandbox_activities = SandboxActivities(boxes.host)
    workers = {
        "workflow": Worker(
            client,
            task_queue=queues.context,
            workflows=[TrajectoryWorkflow, TrajectoryGroupWorkflow, AgentSessionWorkflow],
            activities=context.all(),
        ),
        # as a node's own queue: its turns, and the last observation appended where they were
        "rollout": Worker(
            client, task_queue=queues.rollout, activities=[rollout.generate, context.append_observation]
        ),
        "sandbox-shared": Worker(client, task_queue=queues.sandbox, activities=sandbox_activities.all()),
        "sandbox-host": Worker(client, task_queue=boxes.host.host_queue, activities=sandbox_activities.all()),
    }
    running = {name: (w, asyncio.create_task(w.run())) for name, w in workers.items()}
    built = TrajectoryStack(client, queues, store, boxes, rollout, running)
    try:
        yield built
    finally:
        remaining = list(built.workers.values())
        await asyncio.gather(*(w.shutdown() for w, _ in remaining), return_exceptions=True)
        await asyncio.gather(*(run for _, run in remaining), return_exceptions=True)
        leaked = await asyncio.to_thread(boxes.cleanup)
        store.close()
        assert not leaked, f"test leaked: {leaked}"


@pytest.fixture
async def stack(temporal_server, seaweedfs, sandbox_runtime, stack_config, storage_config, tokenizer_path):
    async with trajectory_stack(stack_config, storage_config, tokenizer_path) as built:
        yield built
