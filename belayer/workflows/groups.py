"""Trajectory groups: one set-up sandbox forked into every member, one prompt for all.

Every member of a GRPO group starts from the same task, so rather than G sandboxes each
running the task's setup (a clone, a venv, package installs), the group creates and sets
up one, checkpoints it (the group's *origin*), and forks the G members' sandboxes from
that checkpoint on the same host (`sandbox.fork`: one download, G restores). The prompt
is tokenized once; each member's token log forks it. A member then starts with its
fork, and keeps the origin as its last-resort recovery source, so a member that loses
its sandbox before its own first checkpoint comes back from the origin, alone.

A failure on the way is never fatal: members whose fork did not start create their own
sandbox as before, and the group's record says why (`fallback`, `notes`). `release`
deletes the origin once every member has ended.

Workflow code (called from TrainingWorkflow and TrajectoryGroupWorkflow): activities
only, times from `workflow.now()`.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError
from temporalio.exceptions import TimeoutError as TemporalTimeout

with workflow.unsafe.imports_passed_through():
    from belayer.contracts import sandbox
    from belayer.contracts.activity import Activity
    from belayer.contracts.context import START_CONTEXT, StartContextArgs
    from belayer.contracts.errors import HOST_REFUSED
    from belayer.contracts.sandbox import (
        CheckpointArgs,
        CreateSandboxArgs,
        DestroyArgs,
        ForkArgs,
        ForkOutcome,
        ForkResult,
        ForkTarget,
        PlaceGroupArgs,
        SandboxHandle,
    )
    from belayer.workflows.models import ForkStart, GroupRecord, TaskQueues, TrajectoryInput, TrajectoryResult
    from belayer.workflows.trajectory import PLACED_RETRY, STATUS_KEY, TASK_KEY
    from belayer.workloads.models import Task
    from belayer.workloads.registry import driver_for

RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)
# Since this patch the set-up sandbox is removed once checkpointed, before its forks start
# from the checkpoint: a group never holds more sandboxes than it has members (the slots
# GroupRunner takes for them, belayer/workflows/rollouts.py).
SETUP_GONE_BEFORE_FORKS_PATCH = "setup-sandbox-gone-before-forks"
# Since this patch the set-up sandbox goes to the least loaded host with room and the forks
# spread over the hosts with room (each host downloads the origin once for its share),
# instead of the set-up on whichever host took it from the shared queue and every fork there.
GROUP_PLACEMENT_PATCH = "groups-placed-over-hosts"
PLACEMENT_TRIES = 3  # hosts tried for the set-up sandbox before the shared queue
ON_HOST_SCHEDULE_TO_START = timedelta(seconds=30)
ANY_HOST_SCHEDULE_TO_START = timedelta(minutes=5)


def member_inputs(inputs: list[TrajectoryInput], starts: list[ForkStart | None]) -> list[TrajectoryInput]:
    return [
        i if s is None else i.model_copy(update={"start_from": s})
        for i, s in zip(inputs, starts, strict=True)
    ]


async def prepare(group_id: str, task: Task, trajectory_ids: list[str], queues: TaskQueues, *,
                  reuse: GroupRecord | None = None) -> tuple[GroupRecord, list[ForkStart | None]]:  # fmt: skip
    """The members' starts, in order (None: start as a lone trajectory). With `reuse` (an
    earlier group of the same task, its origin kept), the members fork that origin and the
    setup is not run again; if that fails the group sets up a sandbox of its own."""
    started = workflow.now()
    record = GroupRecord(group=group_id, task=task.id, size=len(trajectory_ids))
    try:
        prompt = await _prompt(group_id, task, queues)
    except ActivityError as err:
        record.fallback = f"the group's prompt could not be tokenized: {cause_of(err)}"
        return record, [None] * len(trajectory_ids)
    starts: list[ForkStart | None] = [ForkStart(parent=group_id, prompt=prompt) for _ in trajectory_ids]
    spec = driver_for(task).sandbox(task)
    if len(trajectory_ids) < 2 or not (spec.setup_commands or spec.semantics is not None):
        # Forking a sandbox nothing was set up in costs a checkpoint and saves nothing (a task
        # image's sandbox is set up by its start: its files installed, its healthcheck passed).
        record.fallback = (
            "a group of one" if len(trajectory_ids) < 2 else "the task has no setup"
        ) + ": every member creates its own sandbox"
        return record, starts
    if reuse is not None and reuse.origin is not None:
        reused = await _fork_reused(record, reuse, prompt, trajectory_ids, queues, started)
        if reused is not None:
            return record, reused
    stage, discarded, placed = (
        "create and set up the group's sandbox",
        False,
        workflow.patched(GROUP_PLACEMENT_PATCH),
    )
    discarded_at: float | None = None
    try:
        at = workflow.now()
        setup = CreateSandboxArgs(sandbox_id=_sandbox_id(), spec=spec)
        summary = f"group {group_id}: create and set up the sandbox its {len(trajectory_ids)} members fork"
        if placed:
            parent = await _create_placed(setup, queues, summary)
        else:
            parent = await _activity(
                sandbox.CREATE, setup, queue=queues.sandbox, on_host=False, summary=summary
            )
        record.setup_sandbox = parent.handle
        record.setup_s, at, stage = _since(at), workflow.now(), "checkpoint it"
        checkpoint = await _activity(
            sandbox.CHECKPOINT,
            CheckpointArgs(handle=parent.handle),
            queue=parent.handle.host_queue,
            summary=f"group {group_id}: checkpoint the set-up sandbox",
        )
        record.origin = checkpoint.checkpoint
        record.checkpoint_s, at, stage = _since(at), workflow.now(), "fork it"
        if workflow.patched(SETUP_GONE_BEFORE_FORKS_PATCH):
            discarded = True
            discarded_at = workflow.now().timestamp()  # its host's record is rewritten after this
            await _discard(record.setup_sandbox, queues, delete_checkpoints=False)  # the origin stays
            at = workflow.now()
        targets = [ForkTarget(sandbox_id=_sandbox_id(), trajectory=t) for t in trajectory_ids]
        summary = f"group {group_id}: fork {len(targets)} sandboxes"
        if placed:
            forked = await _fork_spread(record.origin, targets, queues, summary,
                                        home=parent.handle.host_queue, changed_at=discarded_at)  # fmt: skip
        else:
            forked = await _activity(sandbox.FORK, ForkArgs(checkpoint=record.origin, targets=targets),
                                     queue=parent.handle.host_queue, summary=summary)  # fmt: skip
        record.fork_s = _since(at)
    except ActivityError as err:
        record.fallback = f"could not {stage}: {cause_of(err)}; every member creates its own sandbox"
        if not discarded:
            await _discard(record.setup_sandbox, queues, delete_checkpoints=False)
        return record, starts
    if not discarded:
        await _discard(record.setup_sandbox, queues, delete_checkpoints=False)  # the origin stays
    _take_forks(record, forked, starts, trajectory_ids, prompt, started)
    return record, starts


async def _fork_reused(record: GroupRecord, reuse: GroupRecord, prompt, trajectory_ids: list[str],
                       queues: TaskQueues, started) -> list[ForkStart | None] | None:  # fmt: skip
    """The members forked from an earlier group's origin; None when none could be."""
    targets = [ForkTarget(sandbox_id=_sandbox_id(), trajectory=t) for t in trajectory_ids]
    summary = f"group {record.group}: fork {len(targets)} sandboxes from {reuse.group}'s setup"
    try:
        if workflow.patched(GROUP_PLACEMENT_PATCH):
            forked = await _fork_spread(reuse.origin, targets, queues, summary)
        else:
            forked = await _activity(sandbox.FORK, ForkArgs(checkpoint=reuse.origin, targets=targets),
                                     queue=queues.sandbox, on_host=False, summary=summary)  # fmt: skip
    except ActivityError as err:
        record.notes.append(
            f"the setup of {reuse.group} could not be forked again: {cause_of(err)}; set up anew"
        )
        return None
    if not any(outcome.handle for outcome in forked.forks):
        record.notes.append(
            f"no fork of {reuse.group}'s setup started ({forked.forks[0].error}); set up anew"
        )
        return None
    record.fork_s = _since(started)
    record.reused_from = reuse.group
    record.origin, record.setup_sandbox = reuse.origin, reuse.setup_sandbox
    starts: list[ForkStart | None] = [ForkStart(parent=record.group, prompt=prompt) for _ in trajectory_ids]
    _take_forks(record, forked, starts, trajectory_ids, prompt, started)
    return starts


def _take_forks(
    record: GroupRecord, forked, starts: list, trajectory_ids: list[str], prompt, started
) -> None:
    for n, outcome in enumerate(forked.forks):
        if outcome.handle is None:
            record.notes.append(f"member {n} ({trajectory_ids[n]}) creates its own sandbox: {outcome.error}")
            continue
        starts[n] = ForkStart(parent=record.group, prompt=prompt, sandbox=outcome.handle,
                              checkpoints=[record.origin])  # fmt: skip
        record.forked += 1
        record.fork_hosts[outcome.handle.host_queue] = record.fork_hosts.get(outcome.handle.host_queue, 0) + 1
        if outcome.closed_tcp_connections:
            record.notes.append(f"member {n} ({trajectory_ids[n]}) started with the set-up sandbox's "
                                f"{outcome.closed_tcp_connections} established TCP sockets closed")  # fmt: skip
    if record.forked == 0:
        record.fallback = "no fork started; every member creates its own sandbox"
    record.ready_s = _since(started)


async def _create_placed(args: CreateSandboxArgs, queues: TaskQueues, summary: str):
    """The set-up sandbox on the least loaded host with room, as a trajectory's own: a host
    that refuses (full, draining) or does not answer is avoided and placement asked again;
    with no host publishing its load, or after `PLACEMENT_TRIES`, the shared queue."""
    avoid: list[str] = []
    for _ in range(PLACEMENT_TRIES):
        placed = await _place_group([args.sandbox_id], avoid, queues)
        if not placed or placed[0] is None:
            break
        try:
            return await _activity(sandbox.CREATE, args, queue=placed[0], summary=f"{summary} on {placed[0]}",
                                   retry=PLACED_RETRY)  # fmt: skip
        except ActivityError as err:
            if not _refused(err):
                raise
            avoid.append(placed[0])
    return await _activity(sandbox.CREATE, args, queue=queues.sandbox, on_host=False, summary=summary)


async def _fork_spread(origin, targets: list[ForkTarget], queues: TaskQueues, summary: str, *,
                       home: str | None = None, changed_at: float | None = None) -> ForkResult:  # fmt: skip
    """The forks spread over the hosts with room, one fork call per host (each downloads the
    origin once, by its hash, for its share), side by side. A fork no host has room for, or
    whose host's call failed, says so: its member creates a sandbox of its own. With no host
    publishing its load, every fork goes to `home` (the set-up's host) or the shared queue."""
    hosts = await _place_group(
        [t.sandbox_id for t in targets], [], queues, changed_host=home, changed_at=changed_at
    )
    if not hosts:
        queue = home or queues.sandbox
        return await _activity(sandbox.FORK, ForkArgs(checkpoint=origin, targets=targets), queue=queue,
                               on_host=home is not None, summary=summary)  # fmt: skip
    shares: dict[str, list[int]] = {}
    for n, host in enumerate(hosts):
        if host is not None:
            shares.setdefault(host, []).append(n)
    calls = [
        _activity(
            sandbox.FORK,
            ForkArgs(checkpoint=origin, targets=[targets[n] for n in share]),
            queue=host,
            summary=f"{summary}: {len(share)} on {host}",
        )  # fmt: skip
        for host, share in shares.items()
    ]
    results = await asyncio.gather(*calls, return_exceptions=True)
    outcomes = [
        ForkOutcome(sandbox_id=t.sandbox_id, error="HostFull: no sandbox host has room for it")
        for t in targets
    ]
    for (host, share), result in zip(shares.items(), results, strict=True):
        for position, n in enumerate(share):
            if isinstance(result, BaseException):
                failed = cause_of(result) if isinstance(result, ActivityError) else str(result)
                outcomes[n] = ForkOutcome(sandbox_id=targets[n].sandbox_id, error=f"on {host}: {failed}")
            else:
                outcomes[n] = result.forks[position]
    return ForkResult(forks=outcomes)


async def _place_group(keys: list[str], avoid: list[str], queues: TaskQueues, *, changed_host: str | None = None,
                       changed_at: float | None = None) -> list[str | None]:  # fmt: skip
    """A host per key (`sandbox.place_group`); empty when no host publishes its load or none answers."""
    try:
        placed = await sandbox.PLACE_GROUP.execute(
            PlaceGroupArgs(keys=keys, avoid=avoid, changed_host=changed_host, changed_at=changed_at),
            task_queue=queues.sandbox,
            start_to_close_timeout=timedelta(seconds=30),
            schedule_to_start_timeout=ANY_HOST_SCHEDULE_TO_START,
            retry_policy=RETRY,
            summary=f"place {len(keys)} sandboxes",
        )
    except ActivityError:
        return []
    return placed.host_queues


def _refused(err: ActivityError) -> bool:
    """The host refused a new sandbox (full, draining) or did not take the call in time."""
    cause = err.cause
    return (isinstance(cause, ApplicationError) and cause.type in HOST_REFUSED) or isinstance(
        cause, TemporalTimeout
    )


async def release(record: GroupRecord, queues: TaskQueues) -> None:
    """Delete the origin: every member has ended, none will recover from it."""
    if record.setup_sandbox is not None:
        await _discard(record.setup_sandbox, queues, delete_checkpoints=True)


async def run_member(input: TrajectoryInput, *, task_queue: str, summary: str, search_attributes,
                     workflow_type: str = "TrajectoryWorkflow") -> TrajectoryResult:  # fmt: skip
    """A member as a child `TrajectoryWorkflow` (or `workflow_type`: an agent session); a child
    that fails outright is failed_infra."""
    try:
        return await workflow.execute_child_workflow(
            workflow_type,
            input,
            id=input.trajectory_id,
            task_queue=task_queue,
            result_type=TrajectoryResult,
            static_summary=summary,
            search_attributes=search_attributes,
        )
    except ChildWorkflowError as err:
        return TrajectoryResult(
            trajectory_id=input.trajectory_id,
            task=input.task.id,
            status="failed_infra",
            reason=f"trajectory workflow failed: {cause_of(err)}",
            turns=0,
            tokens=0,
            reward=None,
            token_sha256=None,
            env_sha256=None,
            recoveries=[],
            checkpoints=0,
        )


async def _prompt(group_id: str, task: Task, queues: TaskQueues):
    result = await START_CONTEXT.execute(
        StartContextArgs(log_key=f"groups/{group_id}/prompt", trajectory_id=group_id,
                         steps_key=f"groups/{group_id}/unused", instruction=driver_for(task).instruction(task),
                         prompt_only=True),
        task_queue=queues.context, start_to_close_timeout=timedelta(seconds=30),
        retry_policy=RETRY, summary=f"group {group_id}: tokenize the prompt its members share",
    )  # fmt: skip
    return result.prefix


async def _activity(activity: Activity, args, *, queue, summary, on_host=True, retry: RetryPolicy = RETRY):
    return await activity.execute(
        args,
        task_queue=queue,
        start_to_close_timeout=timedelta(minutes=10),
        schedule_to_start_timeout=ON_HOST_SCHEDULE_TO_START if on_host else ANY_HOST_SCHEDULE_TO_START,
        heartbeat_timeout=timedelta(seconds=15),
        retry_policy=retry,
        summary=summary,
    )


async def _discard(handle: SandboxHandle | None, queues: TaskQueues, *, delete_checkpoints: bool) -> None:
    """Remove the set-up sandbox (any host can delete its objects; its own removes the container)."""
    if handle is None:
        return
    queue = queues.sandbox if delete_checkpoints else handle.host_queue
    try:
        await _activity(
            sandbox.DESTROY,
            DestroyArgs(handle=handle, delete_checkpoints=delete_checkpoints),
            queue=queue,
            on_host=not delete_checkpoints,
            summary="destroy the group's set-up sandbox",
        )
    except ActivityError:
        pass  # gone with its host; the bucket's lifecycle rule expires what is left


def _sandbox_id() -> str:
    return f"sbx-{workflow.uuid4().hex[:12]}"


def _since(start) -> float:
    return round((workflow.now() - start).total_seconds(), 3)


def cause_of(err: Exception) -> str:
    """What really failed under an activity or child workflow error, as one line."""
    cause = err.cause
    while isinstance(cause, (ActivityError, ChildWorkflowError)) and cause.cause is not None:
        cause = cause.cause
    if isinstance(cause, ApplicationError):
        return f"{cause.type}: {cause.message}"
    return f"{type(cause).__name__}: {cause}" if cause else str(err)


class GroupInput(BaseModel):
    """What a client passes to `TrajectoryGroupWorkflow`: the members of one task's group."""

    model_config = ConfigDict(extra="forbid")

    group_id: str = Field(min_length=1, max_length=180)
    members: list[TrajectoryInput] = Field(
        min_length=1, max_length=256, description="One task, G trajectories."
    )
    fork: bool = Field(
        True,
        description="Fork the members' sandboxes from one set-up sandbox (else each "
        "creates its own, as lone trajectories do).",
    )
    workflow_queue: str = Field(description="Task queue of the members' TrajectoryWorkflows.")
    member_workflow: Literal["TrajectoryWorkflow", "AgentSessionWorkflow"] = Field(
        "TrajectoryWorkflow",
        description="AgentSessionWorkflow: each member is an agent session its client drives (`belayer serve`).",
    )


class GroupResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group: GroupRecord
    results: list[TrajectoryResult]


@workflow.defn(name="TrajectoryGroupWorkflow")
class TrajectoryGroupWorkflow:
    """One task's group outside a training run (`belayer run -n G`): its members run as
    child TrajectoryWorkflows under their own ids, from forks of one set-up sandbox."""

    @workflow.run
    async def run(self, input: GroupInput) -> GroupResult:
        task = input.members[0].task
        ids = [m.trajectory_id for m in input.members]
        if input.fork:
            record, starts = await prepare(input.group_id, task, ids, input.members[0].queues)
        else:
            record, starts = GroupRecord(group=input.group_id, task=task.id, size=len(ids),
                                         fallback="forking turned off"), [None] * len(ids)  # fmt: skip
        try:
            results = await asyncio.gather(*(
                run_member(member, task_queue=input.workflow_queue, summary=f"group {input.group_id}: {task.id}",
                           workflow_type=input.member_workflow,
                           search_attributes=TypedSearchAttributes([SearchAttributePair(TASK_KEY, task.id),
                                                                    SearchAttributePair(STATUS_KEY, "running")]))
                for member in member_inputs(input.members, starts)
            ))  # fmt: skip
        finally:
            if not input.members[0].keep_checkpoints:  # else branches of a member may start from it
                await release(record, input.members[0].queues)
        return GroupResult(group=record, results=list(results))
