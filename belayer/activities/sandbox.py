"""Sandbox activities: one *Args and one *Result model per activity, one error translator.

The workflow holds a `SandboxHandle` (sandbox id, host task queue, generation) and
schedules exec / checkpoint (or its capture and publish halves) / workspace_hash /
destroy on `handle.host_queue`; create and recover go to the host `place` chose
(belayer/sandbox/placement.py), or to any sandbox host (the shared queue
`belayer-sandbox`); recover is how a sandbox whose host is lost comes back elsewhere.
Payloads carry handles, refs and hashes, never archives.

The activities are methods of `SandboxActivities`, bound to one `SandboxHost` per
worker process (belayer/workers/sandbox/). Blocking podman/CRIU work runs in a
thread; long activities heartbeat meanwhile. Every error leaves through
`to_application_error`, the one translator from sandbox and storage errors to
Temporal's ApplicationError(type=..., non_retryable=...).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from temporalio import activity
from temporalio.exceptions import ApplicationError

from belayer.sandbox import placement
from belayer.sandbox.models import (
    Action,
    CheckpointRef,
    ForkOutcome,
    ForkTarget,
    LoggedAction,
    ObservationRef,
    RecoverOutcome,
    SandboxHandle,
    SandboxId,
    SandboxSpec,
    StagedCheckpoint,
)
from belayer.sandbox.observations import store_observation
from belayer.storage.recordlog import RecordLogRef
from belayer.trajectory_log import StepRecord, read_steps

SHARED_QUEUE = "belayer-sandbox"
HEARTBEAT_EVERY_S = 5.0
T = TypeVar("T")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateSandboxArgs(_Model):
    spec: SandboxSpec = Field(default_factory=SandboxSpec, description="Setup commands and labels.")
    sandbox_id: SandboxId | None = Field(
        None,
        description="Lineage id chosen by the workflow (workflow.uuid4()) so a retried create replaces "
        "its own earlier attempt instead of leaking it; default: a fresh one.",
    )


class CreateSandboxResult(_Model):
    handle: SandboxHandle


class ExecArgs(_Model):
    handle: SandboxHandle
    action: Action
    isolated: bool = Field(
        False, description="Run in a clean process that inherits nothing from the agent's shell "
        "(fixed PATH/HOME/locale, no variables, functions or options of the agent): the reward check.",
    )
    processes: Literal["frozen", "running"] = Field(
        "frozen", description="With `isolated`: whether the agent's processes are frozen while the check "
        "runs (and through the workspace hash), or keep running (a task that needs its servers).",
    )


class ExecResult(_Model):
    observation: ObservationRef = Field(description="The observation, stored; its text never enters a payload.")


class CheckpointArgs(_Model):
    handle: SandboxHandle
    token_prefix_len: int | None = Field(None, ge=0, description="Context length at this step.")
    token_prefix_sha256: str | None = Field(None, description="Hash of that token prefix.")
    fs_snapshot: bool = Field(False, description="Also keep a files-only snapshot (fs-only baseline).")


class CheckpointResult(_Model):
    checkpoint: CheckpointRef


class CaptureResult(_Model):
    staged: StagedCheckpoint = Field(description="The captured archive on its host; publish it there.")


class PublishArgs(_Model):
    staged: StagedCheckpoint


class ForkArgs(_Model):
    checkpoint: CheckpointRef = Field(description="A checkpoint of the set-up sandbox (any lineage).")
    targets: list[ForkTarget] = Field(min_length=1, max_length=256, description="One per fork to start.")
    generation: int = Field(1, ge=1, description="Generation each fork's lineage starts at.")


class ForkResult(_Model):
    forks: list[ForkOutcome] = Field(description="In the order of the targets; a failed one says why.")


class RecoverArgs(_Model):
    handle: SandboxHandle
    trajectory_id: str
    checkpoints: list[CheckpointRef] = Field(default_factory=list, description="Newest first.")
    steps: RecordLogRef = Field(
        description="The trajectory's step log (read here, never sent inline): the actions to replay, their "
        "observation hashes, and the context after each -- a checkpoint whose recorded prefix or journal "
        "disagrees with them is skipped as unusable.",
    )
    spec: SandboxSpec = Field(default_factory=SandboxSpec, description="For a replay from the start.")


class RecoverResult(_Model):
    outcome: RecoverOutcome = Field(description="Without the mismatching observation's text (see below).")
    mismatch_observation: ObservationRef | None = Field(None, description="The new observation, stored.")
    mismatch_step: StepRecord | None = Field(None, description="The logged step that no longer matches.")


class PlaceArgs(_Model):
    key: str = Field(min_length=1, max_length=200, description="The sandbox id: spreads equally loaded hosts.")
    avoid: list[str] = Field(default_factory=list, max_length=64,
                             description="Host queues to take only when no other host has room.")


class PlaceResult(_Model):
    host_queue: str | None = Field(None, description="The host to use; None: see `full`.")
    full: bool = Field(False, description="Hosts publish their load but none has room: wait and ask again. "
                       "False with no host_queue: no host publishes its load; use the shared queue.")


class DestroyArgs(_Model):
    handle: SandboxHandle
    delete_checkpoints: bool = Field(False, description="Also delete the lineage's checkpoint objects.")


class DestroyResult(_Model):
    deleted_objects: int = 0


class WorkspaceHashArgs(_Model):
    handle: SandboxHandle
    path: str = "/workspace"


class WorkspaceHashResult(_Model):
    sha256: str


def to_application_error(exc: BaseException) -> BaseException:
    """The one translator: Belayer sandbox/storage errors -> ApplicationError; others unchanged.
    A sandbox error's `details()` (why a sandbox was lost, and at which step) ride along."""
    from belayer.sandbox.errors import SandboxError
    from belayer.storage.errors import StorageError

    if isinstance(exc, (SandboxError, StorageError)):
        details = exc.details() if isinstance(exc, SandboxError) else None
        return ApplicationError(str(exc), *([details] if details else []), type=type(exc).__name__,
                                non_retryable=not exc.retryable)  # fmt: skip
    return exc


def _translated(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except ApplicationError:
            raise
        except Exception as exc:
            translated = to_application_error(exc)
            if translated is exc:
                raise
            raise translated from exc

    return wrapper


async def _blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `fn` in a thread; heartbeat while it runs so a dead worker is noticed."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    while True:
        done, _ = await asyncio.wait({task}, timeout=HEARTBEAT_EVERY_S)
        if done:
            return task.result()
        activity.heartbeat()


class SandboxActivities:
    """The activities of one sandbox host."""

    def __init__(self, host):
        self.host = host

    def all(self) -> list[Callable[..., Any]]:
        return [self.place, self.create, self.exec, self.checkpoint, self.capture_checkpoint, self.publish_checkpoint,
                self.fork, self.recover, self.destroy, self.workspace_hash]

    @activity.defn(name="sandbox.place")
    @_translated
    async def place(self, args: PlaceArgs) -> PlaceResult:
        """The least loaded host with room, from the hosts' load records (any host answers)."""
        loads = await _blocking(placement.read_loads, self.host.store)
        now = time.time()
        queue = placement.choose(loads, now=now, key=args.key, avoid=frozenset(args.avoid))
        return PlaceResult(host_queue=queue, full=queue is None and placement.any_fresh(loads, now=now))

    @activity.defn(name="sandbox.create")
    @_translated
    async def create(self, args: CreateSandboxArgs) -> CreateSandboxResult:
        return CreateSandboxResult(handle=await _blocking(self.host.create, args.spec, sandbox_id=args.sandbox_id))

    @activity.defn(name="sandbox.exec")
    @_translated
    async def exec(self, args: ExecArgs) -> ExecResult:
        return ExecResult(observation=await _blocking(self._exec_and_store, args))

    def _exec_and_store(self, args: ExecArgs) -> ObservationRef:
        """The action, then its observation stored: one thread hop, as the turn waits on both."""
        observation = self.host.exec(args.handle, args.action, isolated=args.isolated, processes=args.processes)
        return store_observation(self.host.store, args.action.trajectory, args.action.step,
                                 args.handle.generation, observation)  # fmt: skip

    @activity.defn(name="sandbox.checkpoint")
    @_translated
    async def checkpoint(self, args: CheckpointArgs) -> CheckpointResult:
        ref = await _blocking(
            self.host.checkpoint, args.handle, token_prefix_len=args.token_prefix_len,
            token_prefix_sha256=args.token_prefix_sha256, fs_snapshot=args.fs_snapshot,
        )  # fmt: skip
        return CheckpointResult(checkpoint=ref)

    @activity.defn(name="sandbox.capture_checkpoint")
    @_translated
    async def capture_checkpoint(self, args: CheckpointArgs) -> CaptureResult:
        """A checkpoint's first half: the sandbox's state to a file here; its next action may
        start once this returns (SandboxHost.capture_checkpoint says why)."""
        staged = await _blocking(self.host.capture_checkpoint, args.handle, token_prefix_len=args.token_prefix_len,
                                 token_prefix_sha256=args.token_prefix_sha256)  # fmt: skip
        return CaptureResult(staged=staged)

    @activity.defn(name="sandbox.publish_checkpoint")
    @_translated
    async def publish_checkpoint(self, args: PublishArgs) -> CheckpointResult:
        """The second half: the captured file compressed into the store."""
        return CheckpointResult(checkpoint=await _blocking(self.host.publish_checkpoint, args.staged))

    @activity.defn(name="sandbox.fork")
    @_translated
    async def fork(self, args: ForkArgs) -> ForkResult:
        """Start the targets from one checkpoint on this host (downloaded once)."""
        forks = await _blocking(self.host.fork, args.checkpoint, args.targets, generation=args.generation)
        return ForkResult(forks=forks)

    @activity.defn(name="sandbox.recover")
    @_translated
    async def recover(self, args: RecoverArgs) -> RecoverResult:
        return await _blocking(self._recover, args)

    def _recover(self, args: RecoverArgs) -> RecoverResult:
        steps = read_steps(self.host.store, args.steps)
        logged = [
            LoggedAction(trajectory=args.trajectory_id, step=s.step, command=s.command,
                         observation_sha256=s.observation.sha256, token_prefix_len=s.context_after_action.length,
                         token_prefix_sha256=s.context_after_action.sha256)
            for s in steps
        ]  # fmt: skip
        outcome = self.host.recover(args.handle, args.checkpoints, logged, spec=args.spec,
                                    trajectory=args.trajectory_id)
        if outcome.mismatch_observation is None:
            return RecoverResult(outcome=outcome)
        ref = store_observation(self.host.store, args.trajectory_id, outcome.mismatch_step,
                                outcome.handle.generation, outcome.mismatch_observation)  # fmt: skip
        step = next(s for s in steps if s.step == outcome.mismatch_step)
        return RecoverResult(outcome=outcome.model_copy(update={"mismatch_observation": None}),
                             mismatch_observation=ref, mismatch_step=step)  # fmt: skip

    @activity.defn(name="sandbox.destroy")
    @_translated
    async def destroy(self, args: DestroyArgs) -> DestroyResult:
        await _blocking(self.host.destroy, args.handle)
        deleted = 0
        if args.delete_checkpoints:
            deleted = await _blocking(self.host.delete_checkpoints, args.handle.sandbox_id)
        return DestroyResult(deleted_objects=deleted)

    @activity.defn(name="sandbox.workspace_hash")
    @_translated
    async def workspace_hash(self, args: WorkspaceHashArgs) -> WorkspaceHashResult:
        return WorkspaceHashResult(sha256=await _blocking(self.host.workspace_hash, args.handle, args.path))
