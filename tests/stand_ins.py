"""Stand-ins for what a training run or a rollout batch drives, on the real Temporal server
and object store: child trajectories that end as their task's id says and write real token
logs, and rollout nodes that record what they were published. The workflows' own logic is
then tested in seconds (tests/training/test_training_workflow.py, tests/test_rollout_api.py)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import activity, workflow

from belayer.activities.runtime import implements
from belayer.contracts.publish import (
    PUBLISH_WEIGHTS,
    WEIGHTS_VERSION,
    PublishWeightsArgs,
    PublishWeightsResult,
)
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
    tasks N."""

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
