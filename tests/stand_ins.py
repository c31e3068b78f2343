"""Stand-ins for what a training run or a rollout batch drives, on the real Temporal server
and object store: child trajectories that end as their task's id says and write real token
logs, and rollout nodes that record what they were published. The workflows' own logic is
then tested in seconds (tests/training/test_training_workflow.py, tests/test_rollout_api.py)."""

from __future__ import annotations

import hashlib
import random
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import activity, workflow

from belayer.activities.runtime import implements
from belayer.contracts import sandbox
from belayer.contracts.context import START_CONTEXT, ContextResult, StartContextArgs
from belayer.contracts.publish import (
    PUBLISH_WEIGHTS,
    WEIGHTS_VERSION,
    PublishWeightsArgs,
    PublishWeightsResult,
)
from belayer.contracts.sandbox import (
    CheckpointArgs,
    CheckpointResult,
    CreateSandboxArgs,
    CreateSandboxResult,
    DestroyArgs,
    DestroyResult,
    ForkArgs,
    ForkResult,
)
from belayer.sandbox.models import CheckpointRef, ForkOutcome, SandboxHandle
from belayer.storage.tokenlog import PrefixRef
from belayer.workflows.models import TrajectoryInput, TrajectoryResult
from tests.token_logs import Written, trajectory

TOKEN_LOG = "standin.token_log"


def reward_of(seed: int) -> float:
    """A stand-in reward that depends only on the member's sampling seed, as a
    deterministic environment's would."""
    return float(hashlib.sha256(str(seed).encode()).digest()[0] % 2)


def actions_of(task_id: str) -> int:
    return int(task_id.split("-")[1]) if task_id.startswith("actions-") else 2


@workflow.defn(name="TrajectoryWorkflow", sandboxed=False)  # a stand-in: nothing to guard
class StandInTrajectory:
    """Ends as `TrajectoryInput.task.id` says: 'infra-always' tasks fail every attempt,
    'infra-once' tasks fail their first attempt only; the rest write a token log of two
    model turns (`TokenLogs`, on the workflow's queue) and score `reward_of(seed)`,
    'held' tasks once they are signalled `release`. Each ran two actions, 'actions-N'
    tasks N. A task with setup commands holds a sandbox for a while (`StandInSandboxes`):
    its fork, or one it creates."""

    def __init__(self) -> None:
        self.released = False

    @workflow.signal
    def release(self) -> None:
        self.released = True

    @workflow.run
    async def run(self, input: TrajectoryInput) -> TrajectoryResult:
        if input.task.id.startswith("held"):
            await workflow.wait_condition(lambda: self.released)
        attempt = int(input.trajectory_id.rsplit("-a", 1)[1])
        infra = input.task.id.startswith("infra-always") or (
            input.task.id.startswith("infra-once") and attempt == 0
        )
        context = None
        if input.task.setup:
            await self._hold_a_sandbox(input)
        if not infra:
            context = await workflow.execute_activity(
                TOKEN_LOG,
                args=[input.trajectory_id, input.sampling.seed],
                result_type=PrefixRef,
                start_to_close_timeout=timedelta(seconds=30),
            )
        reward = None if infra else reward_of(input.sampling.seed)
        return TrajectoryResult(
            trajectory_id=input.trajectory_id,
            task=input.task.id,
            status="failed_infra" if infra else ("completed" if reward else "failed_policy"),
            reason="sandbox host gone" if infra else "",
            turns=0 if infra else actions_of(input.task.id),
            tokens=0 if infra else context.length,
            reward=reward,
            token_sha256=None,
            env_sha256=None,
            recoveries=[],
            checkpoints=0,
            context=context,
        )

    @staticmethod
    async def _hold_a_sandbox(input: TrajectoryInput) -> None:
        options = {"start_to_close_timeout": timedelta(seconds=30)}
        handle = input.start_from.sandbox if input.start_from is not None else None
        if handle is None:
            created = await sandbox.CREATE.execute(
                CreateSandboxArgs(), task_queue=input.queues.sandbox, **options
            )
            handle = created.handle
        await workflow.sleep(0.3)
        await sandbox.DESTROY.execute(DestroyArgs(handle=handle), task_queue=handle.host_queue, **options)


@dataclass
class StandInSandboxes:
    """A sandbox host on `queue` that counts the sandboxes alive, and the most at once: it
    creates, checkpoints and forks them for groups (and tokenizes their prompts), and
    destroys them."""

    queue: str
    store: object
    alive: set[str] = field(default_factory=set)
    most: int = 0
    forked: int = 0

    def activities(self) -> list:
        return [self.create, self.checkpoint, self.fork, self.destroy, self.start_context]

    def _started(self, sandbox_id: str) -> SandboxHandle:
        self.alive.add(sandbox_id)
        self.most = max(self.most, len(self.alive))
        return SandboxHandle(sandbox_id=sandbox_id, host_queue=self.queue, generation=1, container=sandbox_id)

    @implements(sandbox.CREATE)
    async def create(self, args: CreateSandboxArgs) -> CreateSandboxResult:
        return CreateSandboxResult(handle=self._started(args.sandbox_id or f"sbx-{uuid.uuid4().hex[:12]}"))

    @implements(sandbox.CHECKPOINT)
    async def checkpoint(self, args: CheckpointArgs) -> CheckpointResult:
        ref = CheckpointRef(meta_key=f"ck/{args.handle.sandbox_id}/meta.json", step=0, archive_sha256="0" * 64,
                            archive_bytes=0)  # fmt: skip
        return CheckpointResult(checkpoint=ref)

    @implements(sandbox.FORK)
    async def fork(self, args: ForkArgs) -> ForkResult:
        self.forked += len(args.targets)
        return ForkResult(
            forks=[
                ForkOutcome(sandbox_id=t.sandbox_id, handle=self._started(t.sandbox_id)) for t in args.targets
            ]
        )

    @implements(sandbox.DESTROY)
    async def destroy(self, args: DestroyArgs) -> DestroyResult:
        self.alive.discard(args.handle.sandbox_id)
        return DestroyResult()

    @implements(START_CONTEXT)
    async def start_context(self, args: StartContextArgs) -> ContextResult:
        prompt = trajectory(self.store, args.log_key, random.Random(0), version=3, model_turns=())
        return ContextResult(prefix=prompt, appended_tokens=prompt.length)


@dataclass
class TokenLogs:
    """The stand-in trajectories' token logs: each member's seed, and what was written."""

    store: object
    seeds: dict[str, int] = field(default_factory=dict)
    written: dict[str, Written] = field(default_factory=dict)

    @activity.defn(name=TOKEN_LOG)
    async def token_log(self, trajectory_id: str, seed: int) -> PrefixRef:
        self.seeds[trajectory_id] = seed
        self.written[trajectory_id] = Written()
        return trajectory(self.store, f"t/{trajectory_id}", random.Random(seed), version=3,
                          written=self.written[trajectory_id])  # fmt: skip


@dataclass
class StandInNode:
    """A rollout node on `queue` that records what it was published."""

    queue: str
    version: int = 1
    published: list[PublishWeightsArgs] = field(default_factory=list)
    fail_publish_once: bool = False

    def activities(self) -> list:
        return [self.publish_weights, self.weights_version]

    @implements(PUBLISH_WEIGHTS)
    async def publish_weights(self, args: PublishWeightsArgs) -> PublishWeightsResult:
        if self.fail_publish_once:
            self.fail_publish_once = False
            raise RuntimeError("node busy")  # retryable: the workflow's retry policy takes it
        self.published.append(args)
        previous, self.version = self.version, args.version
        return PublishWeightsResult(node_id=self.queue, version=args.version, previous_version=previous,
                                    policy="", fetch_s=0, staged_s=0, written_s=0, sealed_s=0, switched_s=0,
                                    paused_requests=0, drained_requests=0)  # fmt: skip

    @implements(WEIGHTS_VERSION)
    async def weights_version(self) -> int:
        return self.version
