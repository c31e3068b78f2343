"""Sandbox activities: the contracts of belayer/contracts/sandbox.py served, one error translator.

The workflow holds a `SandboxHandle` (sandbox id, host task queue, generation) and
schedules exec / checkpoint (or its capture and publish halves) / workspace_hash /
destroy on `handle.host_queue`; create and recover go to the host `place` chose
(belayer/sandbox/placement.py), or to any sandbox host (the shared queue
`belayer-sandbox`); recover is how a sandbox whose host is lost comes back elsewhere.
Payloads carry handles, refs and hashes, never archives.

The activities are methods of `SandboxActivities`, bound to one `SandboxHost` per
worker process (belayer/workers/sandbox/). Blocking podman/CRIU work runs in a
thread; long activities heartbeat meanwhile. Every error leaves through the activity
runtime's translator (belayer/activities/runtime.py): a sandbox or storage error as
Temporal's ApplicationError(type=its class's name, non_retryable=not retryable).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from temporalio import activity

from belayer.activities.runtime import BY_RETRYABLE, heartbeating, implements
from belayer.contracts import sandbox as contract
from belayer.contracts.sandbox import (
    CaptureResult,
    CheckpointArgs,
    CheckpointResult,
    CreateSandboxArgs,
    CreateSandboxResult,
    DestroyArgs,
    DestroyResult,
    ExecArgs,
    ExecResult,
    ForkArgs,
    ForkResult,
    ObservationRef,
    PlaceArgs,
    PlaceGroupArgs,
    PlaceGroupResult,
    PlaceResult,
    PublishArgs,
    RecoverArgs,
    RecoverResult,
    VerifyArgs,
    VerifyResult,
    WorkspaceHashArgs,
    WorkspaceHashResult,
)
from belayer.sandbox import placement
from belayer.sandbox.models import LoggedAction
from belayer.sandbox.observations import store_observation
from belayer.trajectory_log import read_steps
from belayer.workloads.harbor_reward import judge_check

SHARED_QUEUE = "belayer-sandbox"
HEARTBEAT_EVERY_S = 5.0
T = TypeVar("T")


def _calling_workflow() -> str | None:
    """The id of the workflow whose activity this is (None when called outside one: a
    program or test driving the activities directly)."""
    try:
        return activity.info().workflow_id
    except RuntimeError:
        return None


def _blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Awaitable[T]:
    """Run `fn` in a thread; heartbeat while it runs so a dead worker is noticed."""
    return heartbeating(asyncio.to_thread(fn, *args, **kwargs), every_s=HEARTBEAT_EVERY_S)


class SandboxActivities:
    """The activities of one sandbox host."""

    def __init__(self, host):
        self.host = host

    def all(self) -> list[Callable[..., Any]]:
        return [
            self.place,
            self.place_group,
            self.create,
            self.exec,
            self.checkpoint,
            self.capture_checkpoint,
            self.publish_checkpoint,
            self.fork,
            self.recover,
            self.destroy,
            self.workspace_hash,
            self.verify,
        ]

    @implements(contract.PLACE, BY_RETRYABLE)
    async def place(self, args: PlaceArgs) -> PlaceResult:
        """The least loaded host with room, from the hosts' load records (any host answers)."""
        loads = await _blocking(placement.read_loads, self.host.store)
        now = time.time()
        queue = placement.choose(loads, now=now, key=args.key, avoid=frozenset(args.avoid))
        return PlaceResult(host_queue=queue, full=queue is None and placement.any_fresh(loads, now=now))

    @implements(contract.PLACE_GROUP, BY_RETRYABLE)
    async def place_group(self, args: PlaceGroupArgs) -> PlaceGroupResult:
        """A host for each of a group's forks, spread over the least loaded hosts with room
        (any host answers). The host the caller just changed is read once its record says
        so (it is rewritten at once after a change, and every few seconds anyway)."""
        loads = await _blocking(self._loads_after, args.changed_host, args.changed_at)
        now = time.time()
        if not placement.any_fresh(loads, now=now):
            return PlaceGroupResult(host_queues=[])
        return PlaceGroupResult(
            host_queues=placement.spread(loads, args.keys, now=now, avoid=frozenset(args.avoid))
        )

    def _loads_after(self, host: str | None, at: float | None) -> list:
        deadline = time.monotonic() + placement.HEARTBEAT_S
        while True:
            loads = placement.read_loads(self.host.store)
            behind = [
                load for load in loads if load.host_queue == host and at is not None and load.written_at < at
            ]
            if not behind or time.monotonic() >= deadline:
                return loads
            time.sleep(0.05)

    @implements(contract.CREATE, BY_RETRYABLE)
    async def create(self, args: CreateSandboxArgs) -> CreateSandboxResult:
        handle = await self._starting(
            lambda: self.host.create(args.spec, sandbox_id=args.sandbox_id), lambda made: [made.sandbox_id]
        )
        return CreateSandboxResult(handle=handle)

    async def _starting(self, start: Callable[[], T], started_ids: Callable[[T], list[str]]) -> T:
        """`start()` (it starts sandboxes) in a thread that then records the calling workflow
        as their owner, for the reaper (belayer/sandbox/reaper.py). In that thread, not after
        it: an activity cancelled meanwhile (its workflow terminated from Temporal) leaves
        the thread going, and what it starts must still be the reaper's to remove."""
        owner = _calling_workflow()

        def owned() -> T:
            started = start()
            for sandbox_id in started_ids(started):
                self._owned_by(sandbox_id, owner)
            return started

        return await _blocking(owned)

    def _owned_by(self, sandbox_id: str, workflow_id: str | None) -> None:
        """Record which workflow the sandbox serves, for the reaper (belayer/sandbox/reaper.py)."""
        if workflow_id is not None:
            self.host.owners.record(sandbox_id, workflow_id)

    @implements(contract.EXEC, BY_RETRYABLE)
    async def exec(self, args: ExecArgs) -> ExecResult:
        # A fork is owned by the workflow that forked it until its trajectory's first action.
        self.host.owners.claim(args.handle.sandbox_id, _calling_workflow())
        return ExecResult(observation=await _blocking(self._exec_and_store, args))

    def _exec_and_store(self, args: ExecArgs) -> ObservationRef:
        """The action, then its observation stored: one thread hop, as the turn waits on both."""
        observation = self.host.exec(
            args.handle, args.action, isolated=args.isolated, processes=args.processes
        )
        return store_observation(self.host.store, args.action.trajectory, args.action.step,
                                 args.handle.generation, observation)  # fmt: skip

    @implements(contract.CHECKPOINT, BY_RETRYABLE)
    async def checkpoint(self, args: CheckpointArgs) -> CheckpointResult:
        ref = await _blocking(
            self.host.checkpoint, args.handle, token_prefix_len=args.token_prefix_len,
            token_prefix_sha256=args.token_prefix_sha256, fs_snapshot=args.fs_snapshot,
        )  # fmt: skip
        return CheckpointResult(checkpoint=ref)

    @implements(contract.CAPTURE_CHECKPOINT, BY_RETRYABLE)
    async def capture_checkpoint(self, args: CheckpointArgs) -> CaptureResult:
        """A checkpoint's first half: the sandbox's state to a file here; its next action may
        start once this returns (SandboxHost.capture_checkpoint says why)."""
        staged = await _blocking(self.host.capture_checkpoint, args.handle, token_prefix_len=args.token_prefix_len,
                                 token_prefix_sha256=args.token_prefix_sha256)  # fmt: skip
        return CaptureResult(staged=staged)

    @implements(contract.PUBLISH_CHECKPOINT, BY_RETRYABLE)
    async def publish_checkpoint(self, args: PublishArgs) -> CheckpointResult:
        """The second half: the captured file compressed into the store."""
        return CheckpointResult(checkpoint=await _blocking(self.host.publish_checkpoint, args.staged))

    @implements(contract.FORK, BY_RETRYABLE)
    async def fork(self, args: ForkArgs) -> ForkResult:
        """Start the targets from one checkpoint on this host (downloaded once)."""
        # Each fork's trajectory may not have started yet: the forking workflow (its parent,
        # open while its members run) owns it until the trajectory's first action claims it.
        forks = await self._starting(
            lambda: self.host.fork(args.checkpoint, args.targets, generation=args.generation),
            lambda made: [outcome.sandbox_id for outcome in made if outcome.handle is not None],
        )
        return ForkResult(forks=forks)

    @implements(contract.RECOVER, BY_RETRYABLE)
    async def recover(self, args: RecoverArgs) -> RecoverResult:
        return await self._starting(
            lambda: self._recover(args), lambda made: [made.outcome.handle.sandbox_id]
        )

    def _recover(self, args: RecoverArgs) -> RecoverResult:
        steps = read_steps(self.host.store, args.steps)
        logged = [
            LoggedAction(trajectory=args.trajectory_id, step=s.step, command=s.command,
                         observation_sha256=s.observation.sha256, token_prefix_len=s.context_after_action.length,
                         token_prefix_sha256=s.context_after_action.sha256)
            for s in steps
        ]  # fmt: skip
        outcome = self.host.recover(args.handle, args.checkpoints, logged, spec=args.spec,
                                    trajectory=args.trajectory_id, earliest_step=args.earliest_step)  # fmt: skip
        if outcome.mismatch_observation is None:
            return RecoverResult(outcome=outcome)
        ref = store_observation(self.host.store, args.trajectory_id, outcome.mismatch_step,
                                outcome.handle.generation, outcome.mismatch_observation)  # fmt: skip
        step = next(s for s in steps if s.step == outcome.mismatch_step)
        return RecoverResult(outcome=outcome.model_copy(update={"mismatch_observation": None}),
                             mismatch_observation=ref, mismatch_step=step)  # fmt: skip

    @implements(contract.DESTROY, BY_RETRYABLE)
    async def destroy(self, args: DestroyArgs) -> DestroyResult:
        await _blocking(self.host.destroy, args.handle)
        deleted = 0
        if args.delete_checkpoints:
            deleted = await _blocking(self.host.delete_checkpoints, args.handle.sandbox_id)
        return DestroyResult(deleted_objects=deleted)

    @implements(contract.WORKSPACE_HASH, BY_RETRYABLE)
    async def workspace_hash(self, args: WorkspaceHashArgs) -> WorkspaceHashResult:
        return WorkspaceHashResult(sha256=await _blocking(self.host.workspace_hash, args.handle, args.path))

    @implements(contract.VERIFY, BY_RETRYABLE)
    async def verify(self, args: VerifyArgs) -> VerifyResult:
        """A task's own verifier run, its logs stored, its reward read: a verifier that timed
        out or wrote no usable reward is the agent's failure (reward 0 and why), never a retry."""
        self.host.owners.claim(args.handle.sandbox_id, _calling_workflow())
        return await _blocking(self._verify, args)

    def _verify(self, args: VerifyArgs) -> VerifyResult:
        checked = self.host.verify(args.handle, args.action, args.tests, processes=args.processes)
        trajectory, step = args.action.trajectory, args.action.step
        observation = store_observation(self.host.store, trajectory, step, args.handle.generation,
                                        checked.observation)  # fmt: skip
        found = self.host.collect_artifacts(args.handle, args.artifacts) if args.artifacts else {}
        stored = VerifyResult(
            observation=observation, reward=None, disk_bytes=checked.disk_bytes,
            logs=self._stored(checked.files, f"trajectories/{trajectory}/verifier/step-{step}"),
            artifacts=self._stored(found, f"trajectories/{trajectory}/artifacts/step-{step}"),
        )  # fmt: skip
        reward, reason = judge_check(checked.files, timed_out=checked.observation.timed_out,
                                     timeout_s=args.action.timeout_s, exit_code=checked.observation.exit_code,
                                     reward_key=args.reward_key)  # fmt: skip
        if reward is None:
            return stored.model_copy(update={"reason": reason})
        verified = stored.model_copy(update={"reward": reward.reward, "rewards": reward.rewards})
        return self._begin_next_stage(args, verified) if args.next_stage is not None else verified

    def _stored(self, files: dict[str, bytes], prefix: str) -> dict[str, str]:
        """`files` put in the store under `prefix`: name -> key."""
        keys = {}
        for name, data in sorted(files.items()):
            keys[name] = key = f"{prefix}/{name}"
            self.host.store.put_bytes(key, data)
        return keys

    def _begin_next_stage(self, args: VerifyArgs, verified: VerifyResult) -> VerifyResult:
        """A multi-step task goes on when the stage just checked scored at least its minimum:
        the next stage's files and setup, then what the agent is told, stored as the check's
        step's observation (the trajectory logs it as that step)."""
        stage = args.next_stage
        if stage.min_reward is not None and verified.reward < stage.min_reward:
            return verified.model_copy(update={"reason": f"stopped early: reward {verified.reward:g} is below this "
                                                         f"step's min_reward {stage.min_reward:g}"})  # fmt: skip
        problem = self.host.begin_stage(
            args.handle, stage.uploads, stage.setup_commands, stage.first_setup_step
        )
        if problem is not None:
            return verified.model_copy(update={"reason": f"stopped early: {problem}"})
        trajectory, step = args.action.trajectory, args.action.step
        message = self.host.record_message(args.handle, trajectory, step, stage.message)
        told = store_observation(self.host.store, trajectory, step, args.handle.generation, message)
        return verified.model_copy(update={"next_observation": told})
